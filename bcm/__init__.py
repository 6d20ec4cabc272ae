"""bcm: head-node server for bare-metal GPU clusters."""

import warnings

__version__ = "0.1.0"

# cryptography 46+ deprecates DSA and warns as asyncssh is imported (its DSA support), which put four
# tracebacks-like lines into every server log; bcm never makes nor accepts DSA keys
warnings.filterwarnings("ignore", message="DSA is deprecated", module=r"asyncssh(\.|$)")
