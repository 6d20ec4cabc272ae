"""bcm.resources: the run-time files as package data; in a checkout (editable install) the tree's own dirs."""

from __future__ import annotations

from pathlib import Path

import pytest

from bcm import resources
from bcm.drivers import ansible
from bcm.errors import BcmError
from bcm.services import render
from bcm.settings import Settings

REPO = Path(__file__).resolve().parents[2]


def test_the_editable_install_reads_the_checkout() -> None:
    assert resources.templates_dir() == REPO / "templates"
    assert resources.ansible_dir() == REPO / "ansible"
    assert resources.images_dir() == REPO / "images"


def test_every_lookup_goes_through_resources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BCM_TEMPLATES_DIR", raising=False)
    monkeypatch.delenv("BCM_ANSIBLE_DIR", raising=False)
    assert render.template_dirs() == [resources.templates_dir()]
    assert ansible.playbook_dir() == resources.ansible_dir()
    assert Settings().images.recipes_dir == resources.images_dir()
    assert (resources.templates_dir() / "ipxe" / "boot.ipxe.j2").is_file()
    assert (resources.ansible_dir() / "kubernetes.yml").is_file()


def test_an_override_comes_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BCM_TEMPLATES_DIR", str(tmp_path))
    assert render.template_dirs() == [tmp_path, resources.templates_dir()]


def test_a_missing_data_package_says_to_reinstall(monkeypatch: pytest.MonkeyPatch) -> None:
    def absent(package: str) -> None:
        raise ModuleNotFoundError(package)

    monkeypatch.setattr(resources.resources, "files", absent)
    with pytest.raises(BcmError, match=r"bcm\._data\.templates is not installed: reinstall bcm"):
        resources.templates_dir()
