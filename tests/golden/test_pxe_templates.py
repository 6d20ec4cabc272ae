"""Golden tests: dnsmasq's config (DHCP and proxy-DHCP modes), a host file and every iPXE purpose, rendered
for fixed inputs and compared with exact text; every rendered dnsmasq config is also checked by the real
``dnsmasq --test``.

Regenerate after an intended change with ``BCM_UPDATE_GOLDEN=1 pytest tests/golden`` and review the diff.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from bcm.drivers import dnsmasq
from bcm.errors import DriverError, InvalidInput
from bcm.services.render import render
from bcm.settings import PxeSettings, Settings

GOLDEN = Path(__file__).parent / "pxe"
BOOT_URL = "http://198.18.0.1:8470/boot/v1/ipxe/boot.ipxe"


def _settings(tmp: Path, **pxe: object) -> Settings:
    base: dict[str, object] = {
        "enabled": True,
        "interface": "bcmlab-prov",
        "address": "198.18.0.1",
        "range_start": "198.18.0.100",
        "range_end": "198.18.0.199",
    }
    base.update(pxe)
    return Settings(state_dir=Path("/var/lib/bcm"), pxe=PxeSettings(**base))  # type: ignore[arg-type]


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("BCM_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} differs from its golden copy"


def _conf(tmp: Path, **pxe: object) -> str:
    s = _settings(tmp, **pxe)
    return dnsmasq.render_config(dnsmasq.context(s, dnsmasq.paths(s), BOOT_URL))


@pytest.mark.parametrize(
    ("name", "pxe"),
    [
        ("dnsmasq-dhcp.conf", {}),
        ("dnsmasq-proxy.conf", {"mode": "proxy", "range_start": None, "range_end": None, "ipv6_ra": False}),
        ("dnsmasq-router.conf", {"router": "198.18.0.254", "lease_time": "12h"}),
    ],
)
def test_dnsmasq_config(name: str, pxe: dict[str, object], tmp_path: Path) -> None:
    text = _conf(tmp_path, **pxe)
    _golden(name, text)
    if shutil.which("dnsmasq") is None:
        pytest.skip("dnsmasq-base is not installed")
    conf = tmp_path / name
    conf.write_text(text)
    dnsmasq.check("dnsmasq", conf)


def test_tags_are_mutually_exclusive(tmp_path: Path) -> None:
    """Every boot line names the ipxe tag or its negation (match order is not file order)."""
    for line in _conf(tmp_path).splitlines():
        if line.startswith("dhcp-boot="):
            assert "tag:ipxe," in line or "tag:!ipxe," in line, line
            if "tag:!ipxe" in line:
                assert "tag:efi64" in line or "tag:!efi64" in line, line


def test_no_router_unless_set(tmp_path: Path) -> None:
    assert "dhcp-option=option:router\n" in _conf(tmp_path)
    assert "dhcp-option=option:router,198.18.0.254\n" in _conf(tmp_path, router="198.18.0.254")


def test_dnsmasq_refuses_what_it_cannot_use(tmp_path: Path) -> None:
    conf = tmp_path / "bad.conf"
    conf.write_text("dhcp-range=not-an-address\n")
    if shutil.which("dnsmasq") is None:
        pytest.skip("dnsmasq-base is not installed")
    with pytest.raises(DriverError, match="dnsmasq refuses"):
        dnsmasq.check("dnsmasq", conf)


@pytest.mark.parametrize(
    ("pxe", "field"),
    [
        ({"interface": None}, "pxe.interface"),
        ({"address": None}, "pxe.address"),
        ({"range_start": "198.19.0.5"}, "pxe.range_start"),  # outside the PXE network, still lab space
        ({"range_end": "198.18.0.1"}, "pxe.range_end"),
        ({"range_start": "198.18.0.200", "range_end": "198.18.0.100"}, "pxe.range_start"),
    ],
)
def test_bad_pxe_settings_name_the_field(pxe: dict[str, object], field: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput) as exc:
        _conf(tmp_path, **pxe)
    assert exc.value.field == field


def test_host_files(tmp_path: Path) -> None:
    _golden("host.conf", dnsmasq.render_host("52:54:00:1a:00:01", "198.18.0.50", "gpu01"))
    d = tmp_path / "hosts"
    assert dnsmasq.write_hosts(
        d, [("52:54:00:1a:00:01", "198.18.0.50", "gpu01"), ("52:54:00:1a:00:02", None, "gpu02")]
    ) == (2, 0)
    assert dnsmasq.write_hosts(d, [("52:54:00:1a:00:02", None, "gpu02")]) == (0, 1)
    assert sorted(p.name for p in d.iterdir()) == ["52-54-00-1a-00-02.conf"]
    assert (d / "52-54-00-1a-00-02.conf").read_text().endswith("dhcp-host=52:54:00:1a:00:02,gpu02\n")


IPXE = {
    "boot.ipxe": ("ipxe/boot.ipxe.j2", {"server_url": "http://198.18.0.1:8470"}),
    "discovery.ipxe": (
        "ipxe/discovery.ipxe.j2",
        {
            "mac": "52:54:00:1a:00:01",
            "image": "base:3",
            "kernel_url": "http://198.18.0.1:8470/boot/v1/images/base/3/vmlinuz",
            "initrd_url": "http://198.18.0.1:8470/boot/v1/images/base/3/initramfs.img",
            "cmdline": "console=ttyS0,115200 bcm.discover=http://198.18.0.1:8470/boot/v1/discover bcm.mac=52:54:00:1a:00:01",
        },
    ),
    "image.ipxe": (
        "ipxe/image.ipxe.j2",
        {
            "node": "gpu01",
            "image": "base:3",
            "kernel_url": "http://198.18.0.1:8470/boot/v1/images/base/3/vmlinuz",
            "initrd_url": "http://198.18.0.1:8470/boot/v1/images/base/3/initramfs.img",
            "cmdline": "console=ttyS0,115200 quiet bcm.root=http://198.18.0.1:8470/boot/v1/images/base/3/rootfs.squashfs bcm.token=bcmboot_x",
            "install": None,
        },
    ),
    "install.ipxe": (
        "ipxe/image.ipxe.j2",
        {
            "node": "gpu01",
            "image": "disk:3",
            "kernel_url": "http://198.18.0.1:8470/boot/v1/images/disk/3/vmlinuz",
            "initrd_url": "http://198.18.0.1:8470/boot/v1/images/disk/3/initramfs.img",
            "cmdline": "console=ttyS0,115200 bcm.root=http://198.18.0.1:8470/boot/v1/images/disk/3/rootfs.squashfs bcm.token=bcmboot_x"
            " bcm.install=http://198.18.0.1:8470/boot/v1/install/52:54:00:1a:00:01",
            "install": "full",
        },
    ),
    "refused.ipxe": (
        "ipxe/refused.ipxe.j2",
        {"node": "gpu01", "message": "198.18.0.66 is not the address this boot is bound to"},
    ),
    "local.ipxe": ("ipxe/local.ipxe.j2", {"node": "gpu01", "state": "ready", "disk": False}),
    "local-disk.ipxe": ("ipxe/local.ipxe.j2", {"node": "gpu01", "state": "provisioning", "disk": True}),
    "noimage.ipxe": ("ipxe/noimage.ipxe.j2", {"node": "gpu01", "message": "no image assigned"}),
}


@pytest.mark.parametrize("name", sorted(IPXE))
def test_ipxe_purposes(name: str) -> None:
    template, ctx = IPXE[name]
    text = render(template, **ctx)
    assert text.startswith("#!ipxe\n")
    _golden(name, text)
