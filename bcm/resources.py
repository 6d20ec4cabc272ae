"""Where bcm's run-time files are: templates, Ansible playbooks and image recipes.

They are package data, found through :mod:`importlib.resources`: the packages ``bcm._data.templates``,
``bcm._data.ansible`` and ``bcm._data.images`` are the source tree's top-level ``templates/``,
``ansible/`` and ``images/`` (pyproject.toml maps them; setup.py lists them), so an editable install
reads the checkout and a wheel carries its own copy. Jinja and ansible-playbook need real
directories, so a package that is not on a file system (a zip) is refused with a message.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from bcm.errors import BcmError


def _directory(name: str) -> Path:
    package = f"bcm._data.{name}"
    try:
        root = resources.files(package)
    except ModuleNotFoundError as exc:
        raise BcmError(f"{package} is not installed: reinstall bcm (pip install -e . in a checkout)") from exc
    if not isinstance(root, Path) or not root.is_dir():
        raise BcmError(f"{package} is not a directory on a file system ({root}): install bcm unzipped")
    return root


def templates_dir() -> Path:
    """``templates/``: dnsmasq, iPXE, overlay, image, Slurm, Kubernetes, lab and dashboard templates."""
    return _directory("templates")


def ansible_dir() -> Path:
    """``ansible/``: the playbooks and roles `bcm wlm deploy` runs."""
    return _directory("ansible")


def images_dir() -> Path:
    """``images/``: the image recipes (``<name>.yaml``)."""
    return _directory("images")
