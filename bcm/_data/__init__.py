"""Package data: bcm reads its run-time files through bcm.resources, never by path."""
