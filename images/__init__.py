"""Package data (bcm._data.images): image recipes, one <name>.yaml each; see bcm.resources."""
