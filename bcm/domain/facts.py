"""Hardware facts: pydantic models and pure parsers for the output of ``bcm.agent.facts.FACT_SCRIPT``.

No I/O. Every parser takes text and returns models; a missing, empty or malformed section leaves
its fields empty and adds one line to ``HardwareFacts.warnings`` instead of raising, because one
odd node (old util-linux, no iproute2 JSON, a broken BMC) must still be inventoried.

The models are also what an unauthenticated machine posts to ``/boot/v1/discover``, so every string,
list and integer is bounded and strings hold no control characters (NUL reaches no database; escape
sequences reach no terminal): validating a :class:`HardwareFacts` refuses them (a 422 naming the field).
The parsers drop control characters from what they read, so a node's odd firmware strings never make
its own facts invalid.
"""

from __future__ import annotations

import csv
import json
import re
import shlex
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, Field, computed_field

from bcm.domain.bounds import INT64_MAX

NVIDIA_PCI_VENDOR_ID = "10de"
# Block devices that are not storage a node can be provisioned onto.
_VIRTUAL_DISK_PREFIXES = ("loop", "ram", "zram", "nbd")
_NA_VALUES = {"", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]"}
_NO_DRIVER_MARKERS = ("couldn't communicate with the nvidia driver", "driver/library version mismatch")
_NO_DRIVER_EXIT_STATUS = 9

# C0 controls, DEL and C1 controls (ESC and CSI start terminal escapes; NUL no PostgreSQL text can hold)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROL_BUT_LINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # a message may keep its lines and tabs
MAX_FACT_STRING = 256
MAX_FACT_TEXT = 4096
MAX_FACT_ITEMS = 1024  # disks, NICs, addresses of a NIC, warnings (the bytes of all are capped too)
MAX_PCI_DEVICES = 2048  # an HGX server shows about 400
MAX_GPUS = 64


def _no_control(value: str) -> str:
    if _CONTROL.search(value):
        raise ValueError("control characters are not allowed")
    return value


def _no_control_but_lines(value: str) -> str:
    if _CONTROL_BUT_LINES.search(value):
        raise ValueError("control characters other than newline and tab are not allowed")
    return value


def printable(text: str) -> str:
    """``text`` without control characters (newlines and tabs kept): what a parser stores of what it read."""
    return _CONTROL_BUT_LINES.sub("", text)


FactStr = Annotated[str, Field(max_length=MAX_FACT_STRING), AfterValidator(_no_control)]
FactText = Annotated[str, Field(max_length=MAX_FACT_TEXT), AfterValidator(_no_control_but_lines)]
FactInt = Annotated[int, Field(ge=0, le=INT64_MAX)]  # sizes and counts; a BIGINT holds any of them


class CpuFacts(BaseModel):
    model: FactStr | None = None
    vendor: FactStr | None = None
    architecture: FactStr | None = None
    sockets: FactInt | None = None
    cores: FactInt | None = Field(default=None, description="physical cores, all sockets")
    threads: FactInt | None = Field(default=None, description="logical CPUs")
    numa_nodes: FactInt | None = None


class DiskFacts(BaseModel):
    name: FactStr
    size_bytes: FactInt | None = None
    type: FactStr | None = None
    model: FactStr | None = None
    serial: FactStr | None = None
    rotational: bool | None = None
    transport: FactStr | None = None


class NicFacts(BaseModel):
    name: FactStr
    mac: FactStr | None = None
    speed_mbps: FactInt | None = None
    mtu: FactInt | None = None
    state: FactStr | None = None
    physical: bool | None = None
    addresses: list[FactStr] = Field(
        default_factory=list, max_length=MAX_FACT_ITEMS, description="CIDR notation"
    )


class OsFacts(BaseModel):
    id: FactStr | None = None
    name: FactStr | None = None
    version_id: FactStr | None = None
    pretty_name: FactStr | None = None


class DmiFacts(BaseModel):
    sys_vendor: FactStr | None = None
    product_name: FactStr | None = None
    product_serial: FactStr | None = None
    board_vendor: FactStr | None = None
    board_name: FactStr | None = None
    bios_version: FactStr | None = None


class PciDevice(BaseModel):
    slot: FactStr
    class_name: FactStr | None = None
    class_id: FactStr | None = None
    vendor_name: FactStr | None = None
    vendor_id: FactStr | None = None
    device_name: FactStr | None = None
    device_id: FactStr | None = None
    subsystem_vendor_id: FactStr | None = None
    subsystem_id: FactStr | None = None
    revision: FactStr | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def is_nvidia(self) -> bool:
        return self.vendor_id == NVIDIA_PCI_VENDOR_ID


class GpuFacts(BaseModel):
    index: Annotated[int, Field(ge=0, lt=1024)]
    uuid: FactStr
    name: FactStr | None = None
    memory_mib: FactInt | None = None
    serial: FactStr | None = None
    pci_bus_id: FactStr | None = None
    driver_version: FactStr | None = None
    vbios_version: FactStr | None = None


class GpuToolStatus(StrEnum):
    """What nvidia-smi said, so "no GPUs" and "GPUs but no driver" are told apart."""

    OK = "ok"
    ABSENT = "absent"  # nvidia-smi is not installed
    NO_DRIVER = "no_driver"  # installed, but the kernel driver is not loaded (exit 9)
    FAILED = "failed"  # any other failure
    NOT_RUN = "not_run"  # the section is missing from the output


class BmcFacts(BaseModel):
    ip_address: FactStr | None = None
    ip_source: FactStr | None = None
    mac: FactStr | None = None
    subnet_mask: FactStr | None = None
    gateway: FactStr | None = None


class HardwareFacts(BaseModel):
    """Everything one fact collection found; JSON-serialisable for a JSON column."""

    format_version: FactInt | None = None
    hostname: FactStr | None = None
    kernel: FactStr | None = None
    cpu: CpuFacts = Field(default_factory=CpuFacts)
    memory_bytes: FactInt | None = None
    disks: list[DiskFacts] = Field(default_factory=list, max_length=MAX_FACT_ITEMS)
    nics: list[NicFacts] = Field(default_factory=list, max_length=MAX_FACT_ITEMS)
    os: OsFacts = Field(default_factory=OsFacts)
    dmi: DmiFacts = Field(default_factory=DmiFacts)
    pci_devices: list[PciDevice] = Field(default_factory=list, max_length=MAX_PCI_DEVICES)
    gpus: list[GpuFacts] = Field(default_factory=list, max_length=MAX_GPUS)
    gpu_tool: GpuToolStatus = GpuToolStatus.NOT_RUN
    gpu_tool_message: FactText | None = None
    bmc: BmcFacts | None = None
    warnings: list[FactText] = Field(default_factory=list, max_length=MAX_FACT_ITEMS)

    @property
    def bmc_address(self) -> str | None:
        return self.bmc.ip_address if self.bmc else None

    @property
    def nvidia_pci_devices(self) -> list[PciDevice]:
        return [d for d in self.pci_devices if d.is_nvidia]


@dataclass(frozen=True)
class Section:
    """One ``@@@ begin`` … ``@@@ end`` block."""

    name: str
    text: str
    exit_status: int | None = None  # None: tool missing, or the end marker was lost
    missing_tool: str | None = None

    @property
    def ok(self) -> bool:
        return self.exit_status == 0 and bool(self.text.strip())


_BEGIN = re.compile(r"^@@@ begin (\S+)\s*$")
_END = re.compile(r"^@@@ end (\S+)(?: rc=(\d+))?(?: missing=(\S+))?\s*$")
_VERSION = re.compile(r"^@@@ bcm-facts (\d+)\s*$")


def split_sections(text: str) -> tuple[int | None, dict[str, Section]]:
    """Split script output into sections; a section cut off by a lost connection keeps its text."""
    version: int | None = None
    sections: dict[str, Section] = {}
    name: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        if m := _VERSION.match(line):
            version = int(m.group(1))
        elif m := _BEGIN.match(line):
            if name is not None:
                sections[name] = Section(name, "\n".join(lines).strip("\n"))
            name, lines = m.group(1), []
        elif name is not None and (m := _END.match(line)) and m.group(1) == name:
            rc = int(m.group(2)) if m.group(2) is not None else None
            sections[name] = Section(name, "\n".join(lines).strip("\n"), rc, m.group(3))
            name, lines = None, []
        elif name is not None:
            lines.append(line)
    if name is not None:
        sections[name] = Section(name, "\n".join(lines).strip("\n"))
    return version, sections


def _clean(value: Any) -> str | None:
    if value is None:
        return None
    text = _CONTROL.sub("", str(value)).strip()[:MAX_FACT_STRING]
    return None if text.lower() in _NA_VALUES else text


def _int(value: Any) -> int | None:
    text = _clean(value)
    if text is None:
        return None
    try:
        number = int(text)
    except ValueError:  # not a number, or more digits than Python converts
        return None
    return number if 0 <= number <= INT64_MAX else None


def _flatten_lscpu(entries: list[Any], out: dict[str, str]) -> None:
    # util-linux >= 2.37 may nest fields under "children"; older versions are flat.
    for entry in entries:
        if isinstance(entry, dict):
            field = str(entry.get("field", "")).rstrip(":").strip()
            if field and field not in out and entry.get("data") is not None:
                out[field] = str(entry["data"])
            _flatten_lscpu(entry.get("children") or [], out)


def parse_lscpu_json(text: str) -> CpuFacts:
    fields: dict[str, str] = {}
    _flatten_lscpu(json.loads(text)["lscpu"], fields)
    sockets = _int(fields.get("Socket(s)"))
    per_socket = _int(fields.get("Core(s) per socket"))
    # Some ARM servers report "Socket(s): -" and cores per cluster instead.
    if sockets is None and _int(fields.get("Cluster(s)")) is not None:
        sockets = _int(fields.get("Cluster(s)"))
        per_socket = per_socket or _int(fields.get("Core(s) per cluster"))
    return CpuFacts(
        model=_clean(fields.get("Model name")),
        vendor=_clean(fields.get("Vendor ID")),
        architecture=_clean(fields.get("Architecture")),
        sockets=sockets,
        cores=sockets * per_socket if sockets and per_socket else None,
        threads=_int(fields.get("CPU(s)")),
        numa_nodes=_int(fields.get("NUMA node(s)")),
    )


def parse_cpuinfo(text: str) -> CpuFacts:
    """Fallback for nodes without ``lscpu -J``: count processors, physical ids and cores."""
    threads = 0
    model = vendor = None
    cores_by_socket: dict[str, int] = {}
    physical_id = "0"
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "processor":
            threads += 1
        elif key == "model name" and model is None:
            model = _clean(value)
        elif key == "vendor_id" and vendor is None:
            vendor = _clean(value)
        elif key == "physical id":
            physical_id = value
        elif key == "cpu cores" and value.isdigit():
            cores_by_socket[physical_id] = int(value)
    return CpuFacts(
        model=model,
        vendor=vendor,
        sockets=len(cores_by_socket) or None,
        cores=sum(cores_by_socket.values()) or None,
        threads=threads or None,
    )


def parse_meminfo(text: str) -> int | None:
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                unit = parts[2].lower() if len(parts) > 2 else "b"
                return _int(int(parts[1]) * (1024 if unit == "kb" else 1))
    return None


def _bool(value: Any) -> bool | None:
    # lsblk < 2.33 prints "1"/"0" strings; newer prints JSON booleans.
    if isinstance(value, bool):
        return value
    text = _clean(value)
    return None if text is None else text in {"1", "true"}


def parse_lsblk_json(text: str) -> list[DiskFacts]:
    disks = []
    for dev in json.loads(text).get("blockdevices", []):
        name = _clean(dev.get("name"))
        if not name or name.startswith(_VIRTUAL_DISK_PREFIXES) or dev.get("type") != "disk":
            continue
        disks.append(
            DiskFacts(
                name=name,
                size_bytes=_int(dev.get("size")),
                type=_clean(dev.get("type")),
                model=_clean(dev.get("model")),
                serial=_clean(dev.get("serial")),
                rotational=_bool(dev.get("rota")),
                transport=_clean(dev.get("tran")),
            )
        )
    return disks


def parse_ip_json(text: str) -> list[NicFacts]:
    """``ip -j addr`` (or ``ip -j link``, which lacks addresses); loopback is left out."""
    nics = []
    for link in json.loads(text):
        if link.get("link_type") == "loopback" or not link.get("ifname"):
            continue
        addresses = [
            f"{a['local']}/{a['prefixlen']}"
            for a in link.get("addr_info", [])
            if "local" in a and "prefixlen" in a
        ]
        nics.append(
            NicFacts(
                name=_clean(link["ifname"]) or "?",
                mac=_clean(link.get("address")),
                mtu=_int(link.get("mtu")),
                state=(_clean(link.get("operstate")) or "").lower() or None,
                addresses=addresses,
            )
        )
    return nics


def parse_netsys(text: str) -> dict[str, NicFacts]:
    """The script's tab-separated /sys/class/net table: name, mac, state, speed, mtu, physical."""
    nics = {}
    for line in text.splitlines():
        cols = line.split("\t")
        if len(cols) < 6 or cols[0] == "lo":
            continue
        speed = _int(cols[3])
        nics[cols[0]] = NicFacts(
            name=_clean(cols[0]) or "?",
            mac=_clean(cols[1]),
            state=_clean(cols[2]),
            speed_mbps=speed if speed is not None and speed > 0 else None,
            mtu=_int(cols[4]),
            physical=cols[5] == "1",
        )
    return nics


def parse_os_release(text: str) -> OsFacts:
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, raw = line.partition("=")
        if not sep or not key.strip() or key.lstrip().startswith("#"):
            continue
        try:
            parts = shlex.split(raw)
        except ValueError:
            parts = [raw.strip("\"'")]
        values[key.strip()] = parts[0] if parts else ""
    return OsFacts(
        id=_clean(values.get("ID")),
        name=_clean(values.get("NAME")),
        version_id=_clean(values.get("VERSION_ID")),
        pretty_name=_clean(values.get("PRETTY_NAME")),
    )


_DMI_PLACEHOLDERS = {"to be filled by o.e.m.", "default string", "system serial number", "not specified"}


def parse_dmi(text: str) -> DmiFacts:
    values: dict[str, str | None] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key in DmiFacts.model_fields:
            cleaned = _clean(value)
            values[key] = None if cleaned and cleaned.lower() in _DMI_PLACEHOLDERS else cleaned
    return DmiFacts.model_validate(values)


_PCI_ID = re.compile(r"^(.*?)\s*\[([0-9a-fA-F]{4})\]$")


def _name_and_id(field: str) -> tuple[str | None, str | None]:
    m = _PCI_ID.match(field.strip())
    if not m:
        return _clean(field), None
    return _clean(m.group(1)), m.group(2).lower()


def parse_lspci(text: str) -> list[PciDevice]:
    """``lspci -Dnnmm``: slot "class [cccc]" "vendor [vvvv]" "device [dddd]" -rXX -pXX "subvendor" "subdev"."""
    devices = []
    for line in text.splitlines():
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        options = [w for w in words if w.startswith("-") and len(w) > 2 and w[1] in "rp"]
        fields = [w for w in words if w not in options]
        if len(fields) < 4:
            continue
        class_name, class_id = _name_and_id(fields[1])
        vendor_name, vendor_id = _name_and_id(fields[2])
        device_name, device_id = _name_and_id(fields[3])
        sub_vendor_id = _name_and_id(fields[4])[1] if len(fields) > 4 else None
        sub_id = _name_and_id(fields[5])[1] if len(fields) > 5 else None
        revision = next((o[2:] for o in options if o[1] == "r"), None)
        devices.append(
            PciDevice(
                slot=_clean(fields[0]) or "?",
                class_name=class_name,
                class_id=class_id,
                vendor_name=vendor_name,
                vendor_id=vendor_id,
                device_name=device_name,
                device_id=device_id,
                subsystem_vendor_id=sub_vendor_id,
                subsystem_id=sub_id,
                revision=revision,
            )
        )
    return devices


_GPU_FIELDS = ("index", "uuid", "name", "memory.total", "serial", "pci.bus_id", "driver_version", "vbios")


def parse_nvidia_smi_csv(text: str) -> list[GpuFacts]:
    """``nvidia-smi --query-gpu=index,uuid,name,memory.total,serial,pci.bus_id,driver_version,
    vbios_version --format=csv,noheader,nounits``; lines that are not 8 fields are skipped."""
    gpus = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if len(row) != len(_GPU_FIELDS):
            continue
        index, uuid = _int(row[0]), _clean(row[1])
        if index is None or uuid is None:
            continue
        gpus.append(
            GpuFacts(
                index=index,
                uuid=uuid,
                name=_clean(row[2]),
                memory_mib=_int(row[3]),
                serial=_clean(row[4]),
                pci_bus_id=_clean(row[5]),
                driver_version=_clean(row[6]),
                vbios_version=_clean(row[7]),
            )
        )
    return sorted(gpus, key=lambda g: g.index)


def classify_nvidia_smi(section: Section | None) -> tuple[GpuToolStatus, str | None]:
    if section is None:
        return GpuToolStatus.NOT_RUN, None
    if section.missing_tool:
        return GpuToolStatus.ABSENT, None
    message = printable(section.text).strip()[:MAX_FACT_TEXT] or None
    if section.exit_status == 0:
        return GpuToolStatus.OK, None
    lowered = section.text.lower()
    if section.exit_status == _NO_DRIVER_EXIT_STATUS or any(m in lowered for m in _NO_DRIVER_MARKERS):
        return GpuToolStatus.NO_DRIVER, message
    return GpuToolStatus.FAILED, message


def parse_ipmitool_lan(text: str) -> BmcFacts | None:
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() and key.strip() not in values:
            values[key.strip()] = value.strip()
    bmc = BmcFacts(
        ip_address=_clean(values.get("IP Address")),
        ip_source=_clean(values.get("IP Address Source")),
        mac=_clean(values.get("MAC Address")),
        subnet_mask=_clean(values.get("Subnet Mask")),
        gateway=_clean(values.get("Default Gateway IP")),
    )
    if bmc.ip_address == "0.0.0.0":  # an unconfigured BMC reports this
        bmc.ip_address = None
    return bmc if any(bmc.model_dump().values()) else None


def _merge_nics(ip_nics: list[NicFacts], sys_nics: dict[str, NicFacts]) -> list[NicFacts]:
    if not ip_nics:
        return list(sys_nics.values())
    merged = []
    for nic in ip_nics:
        extra = sys_nics.get(nic.name)
        if extra is not None:
            nic = nic.model_copy(update={"speed_mbps": extra.speed_mbps, "physical": extra.physical})
        merged.append(nic)
    return merged


def parse_fact_output(text: str) -> HardwareFacts:
    """Turn FACT_SCRIPT output into HardwareFacts; never raises on odd input, records warnings."""
    version, sections = split_sections(text)
    facts = HardwareFacts(format_version=version)

    def warn(line: str) -> None:
        if len(facts.warnings) < MAX_FACT_ITEMS:
            facts.warnings.append(printable(line)[:MAX_FACT_TEXT])

    if version is None:
        warn("output has no '@@@ bcm-facts' header; not produced by FACT_SCRIPT?")

    def usable(name: str) -> Section | None:
        section = sections.get(name)
        if section is None or section.missing_tool:
            return None
        if section.exit_status is None:
            warn(f"section {name}: output cut off before its end marker")
        elif section.exit_status != 0:
            warn(f"section {name}: exited {section.exit_status}")
            return None
        return section if section.text.strip() else None

    def guarded(name: str, parse: Any) -> Any:
        section = usable(name)
        if section is None:
            return None
        try:
            return parse(section.text)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            warn(f"section {name}: unparseable ({type(exc).__name__}: {exc})")
            return None

    if hostname := guarded("hostname", lambda t: _clean(t.strip().splitlines()[0])):
        facts.hostname = hostname
    if kernel := guarded("kernel", lambda t: _clean(t.strip().splitlines()[0])):
        facts.kernel = kernel
    cpu = guarded("lscpu", parse_lscpu_json) or guarded("cpuinfo", parse_cpuinfo)
    if cpu is not None:
        facts.cpu = cpu
    facts.memory_bytes = guarded("meminfo", parse_meminfo)
    facts.disks = guarded("lsblk", parse_lsblk_json) or []
    ip_nics = guarded("ipaddr", parse_ip_json) or guarded("iplink", parse_ip_json) or []
    facts.nics = _merge_nics(ip_nics, guarded("netsys", parse_netsys) or {})
    if (os_facts := guarded("osrelease", parse_os_release)) is not None:
        facts.os = os_facts
    if (dmi := guarded("dmi", parse_dmi)) is not None:
        facts.dmi = dmi
    facts.pci_devices = guarded("lspci", parse_lspci) or []
    facts.gpu_tool, facts.gpu_tool_message = classify_nvidia_smi(sections.get("nvidiasmi"))
    if facts.gpu_tool is GpuToolStatus.OK:
        facts.gpus = guarded("nvidiasmi", parse_nvidia_smi_csv) or []
    facts.bmc = guarded("ipmilan", parse_ipmitool_lan)
    if facts.gpu_tool is not GpuToolStatus.OK and facts.nvidia_pci_devices:
        warn(f"{len(facts.nvidia_pci_devices)} NVIDIA PCI devices but nvidia-smi is {facts.gpu_tool.value}")
    return facts
