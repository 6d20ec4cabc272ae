"""Package data (bcm._data.templates): Jinja templates at the path they render to; see bcm.resources."""
