"""Package data (bcm._data.ansible): playbooks and roles for `bcm wlm deploy`; see bcm.resources."""
