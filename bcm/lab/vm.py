"""Lab VMs: qemu machines on the lab bridge, each behind its own simulated BMC.

VM i is ``vm<i>``: a tap ``tapvm<i>`` on br0, and a BMC on ``<subnet>.<200+i>`` (an address on br0
in the bridge namespace) — odd VMs get an IPMI BMC (ipmi_sim, UDP 623), even ones a Redfish BMC
(sushy-tools, TCP 8000). The BMC owns the VM's power: "on" is the qemu process running (TCG, paused
with ``-S``: power tests need no guest OS, and two cores must not spin on emulated CPUs).
Everything runs in the bridge namespace, so the lab's teardown (every process in its namespaces)
takes the BMCs and the VMs with it; ``vms.json`` in the lab's state directory records them.
"""

from __future__ import annotations

import ipaddress
import json
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from bcm.lab import bmc, net, procs
from bcm.lab.errors import LabError

FIRST_BMC_HOST = 200
MAX_VMS = 8
VM_MEMORY_MIB = 1536  # a stateless boot holds the root image in RAM (allocated only as the guest uses it)
BMC_USER = "admin"
PORTS = {"ipmi": 623, "redfish": 8000}


@dataclass
class LabVm:
    name: str
    index: int
    mac: str
    tap: str
    bmc: bmc.BmcSpec
    bmc_pid: int | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "index": self.index,
            "mac": self.mac,
            "tap": self.tap,
            "bmc": self.bmc.to_dict(),
            "bmc_pid": self.bmc_pid,
        }

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> LabVm:
        spec = bmc.BmcSpec(**d["bmc"])  # type: ignore[arg-type]
        return cls(str(d["name"]), int(d["index"]), str(d["mac"]), str(d["tap"]), spec, d.get("bmc_pid"))  # type: ignore[arg-type,call-overload]


def vm_mac(index: int) -> str:
    return f"52:54:00:1a:{index >> 8:02x}:{index & 0xFF:02x}"


def parse_disk_size(value: str) -> int:
    """``8G``, ``512M``: a lab VM's disk size in bytes (64 MiB to 64 GiB: the lab's disks are sparse files)."""
    m = re.fullmatch(r"([1-9][0-9]{0,5})([MG])", value.strip())
    if not m:
        raise LabError(f"--disk: {value[:16]!r} is not a size like 8G or 512M")
    size = int(m.group(1)) << (20 if m.group(2) == "M" else 30)
    if not 64 << 20 <= size <= 64 << 30:
        raise LabError(f"--disk: {value} is not between 64M and 64G")
    return size


def make_disk(path: Path, size: int) -> None:
    """A sparse qcow2 of ``size`` bytes (qemu-img); an existing one is replaced (a new lab, a blank disk)."""
    qemu_img = shutil.which("qemu-img")
    if qemu_img is None:
        raise LabError("qemu-img is not installed (Debian package qemu-utils)")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    procs.run([qemu_img, "create", "-q", "-f", "qcow2", str(path), str(size)])


def qemu_argv(
    name: str,
    tap: str,
    mac: str,
    serial_log: Path | None = None,
    bmc_oem: str | None = None,
    disk: Path | None = None,
) -> list[str]:
    """The VM's command line. It starts paused (``-S``) unless it boots from the network (the chassis drops
    ``-S`` then): a powered-on machine with nothing to boot needs no CPU, one that PXE-boots runs.

    ``bmc_oem``: the VM names its BMC in an SMBIOS OEM string (type 11), ``bcm.bmc=<protocol>:<address>``,
    as a real machine's BMC answers ipmitool's LAN print; bcm's discovery image reports it."""
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        raise LabError("qemu-system-x86_64 is not installed (Debian package qemu-system-x86)")
    serial = f"file:{serial_log}" if serial_log else "none"
    return [
        qemu,
        "-name",
        name,
        "-accel",
        "tcg",
        "-cpu",
        "max",
        "-m",
        str(VM_MEMORY_MIB),
        "-smp",
        "1",
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-serial",
        serial,
        "-monitor",
        "none",
        "-no-reboot",
        "-S",
        "-boot",
        "{boot}",
        "-netdev",
        f"tap,id=n0,ifname={tap},script=no,downscript=no",
        "-device",
        f"virtio-net-pci,netdev=n0,mac={mac}",
        *(["-smbios", "type=11,value=" + bmc_oem.replace(",", ",,")] if bmc_oem else []),
        # a disk (#30): virtio, BIOS drive 0x80 (iPXE's local purpose boots it); the disk boots after the network
        *(["-drive", f"file={disk},format=qcow2,if=virtio,cache=unsafe"] if disk else []),
    ]


def up(
    state_dir: Path,
    netns: str,
    subnet: ipaddress.IPv4Network,
    count: int,
    bmc_password: str | None = None,
    disk_bytes: int | None = None,
) -> list[LabVm]:
    """Make ``count`` VMs (powered off) with their BMCs listening; records them in ``vms.json``.

    Each BMC gets its own random password, or ``bmc_password`` for all (a site's BMCs share the password its
    category holds: zero-touch). ``disk_bytes``: each VM gets a blank qcow2 disk of that size,
    ``vms/<name>/disk.qcow2`` under the lab's state directory (#30)."""
    if not 0 <= count <= MAX_VMS:
        raise LabError(f"a lab has 0 to {MAX_VMS} VMs, not {count}")
    vms: list[LabVm] = []
    for i in range(1, count + 1):
        kind = "ipmi" if i % 2 else "redfish"
        name, tap = f"vm{i:02d}", f"tapvm{i}"
        address = subnet.network_address + FIRST_BMC_HOST + i
        if address not in subnet or address == subnet.broadcast_address:
            raise LabError(f"no room for the BMC of {name} in {subnet}")
        spec = bmc.BmcSpec(
            kind,
            name,
            str(address),
            PORTS[kind],
            BMC_USER,
            bmc_password or secrets.token_urlsafe(12),
            str(state_dir / "vms" / name),
        )
        vms.append(LabVm(name, i, vm_mac(i), tap, spec))
    _save(state_dir, vms)
    for vm in vms:
        procs.run(
            ["ip", "-n", netns, "-batch", "-"],
            stdin=(
                f"tuntap add dev {vm.tap} mode tap\n"
                f"link set {vm.tap} master {net.BRIDGE} up\n"
                f"addr add {vm.bmc.listen}/{subnet.prefixlen} dev {net.BRIDGE}\n"
            ),
        )
        oem = f"bcm.bmc={vm.bmc.kind}:{vm.bmc.address}"
        disk = vm.bmc.dir / "disk.qcow2" if disk_bytes else None
        if disk is not None and disk_bytes:
            make_disk(disk, disk_bytes)
        bmc.write_machine(vm.bmc, qemu_argv(vm.name, vm.tap, vm.mac, vm.bmc.dir / "serial.log", oem, disk))
        vm.bmc_pid = bmc.start(vm.bmc, netns=netns, mac=vm.mac).pid
        _save(state_dir, vms)
    return vms


def load(state_dir: Path) -> list[LabVm]:
    try:
        data = json.loads((state_dir / "vms.json").read_text())
    except FileNotFoundError:
        return []
    except json.JSONDecodeError as exc:
        raise LabError(f"{state_dir / 'vms.json'} is corrupt; run `down` to clean up") from exc
    return [LabVm.from_dict(d) for d in data]


def remove(state_dir: Path) -> None:
    """After the lab's processes are gone: stop any VM that outlived its BMC, drop the files."""
    try:
        vms = load(state_dir)
    except LabError:
        vms = []
    for vm in vms:
        bmc.stop(vm.bmc_pid, vm.bmc.dir)
    shutil.rmtree(state_dir / "vms", ignore_errors=True)
    (state_dir / "vms.json").unlink(missing_ok=True)


def _save(state_dir: Path, vms: list[LabVm]) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / "vms.json.tmp"
    tmp.write_text(json.dumps([vm.to_dict() for vm in vms], indent=2) + "\n")
    tmp.chmod(0o600)  # holds the lab BMCs' passwords
    tmp.replace(state_dir / "vms.json")
