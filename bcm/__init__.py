"""bcm: head-node server for bare-metal GPU clusters."""
__version__ = "0.1.0"
