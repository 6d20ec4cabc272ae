"""Turn NVML readings and kernel-log lines into one health report (see :mod:`bcm.agent.schema`).

The collector talks only to :class:`bcm.agent.nvml.NvmlBackend`. Metrics a GPU or driver does not offer
become ``None`` and are listed in the GPU's ``unsupported``; any other NVML failure is recorded in the
GPU's ``errors`` (and ``GPU_IS_LOST`` marks the GPU ``lost``), so one bad reading never loses the report.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import bcm
from bcm.agent import schema
from bcm.agent.nvml import (
    CLOCK_EVENT_REASONS,
    ERROR_GPU_IS_LOST,
    ERROR_INVALID_ARGUMENT,
    NVLINK_COUNTERS,
    NVLINK_MAX_LINKS,
    RECOVERY_ACTIONS,
    NvmlBackend,
    NvmlError,
)

T = TypeVar("T")

_BUS_ID = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<dev>[0-9a-fA-F]{1,2})(?:\.(?P<fn>[0-7]))?$"
)
# "NVRM: Xid (PCI:0000:18:00): 79, pid=1234, name=python, GPU has fallen off the bus." Old drivers omit
# "PCI:"; the rest of the line is free text.
_XID_LINE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)\): "
    r"(?P<xid>\d+)(?:, (?P<rest>.*))?"
)
# Xid 154: "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)".
_RECOVERY_CHANGE = re.compile(
    r"recovery action changed from 0x[0-9a-fA-F]+ \([^)]*\) to 0x(?P<code>[0-9a-fA-F]+)"
)
_RECOVERY_WORDS = {
    "none": "none",
    "gpu reset required": "gpu_reset",
    "node reboot required": "node_reboot",
    "os reboot": "node_reboot",
    "drain p2p": "drain_p2p",
    "drain and reset": "drain_and_reset",
}


def utc_iso(epoch_s: float) -> str:
    """Seconds since the epoch as ISO 8601 UTC with a ``Z``."""
    return (
        dt.datetime.fromtimestamp(epoch_s, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


def normalize_bus_id(bus_id: str) -> str | None:
    """``00000000:18:00.0`` (NVML) and ``0000:18:00`` (kernel log) both become ``0000:18:00.0``."""
    match = _BUS_ID.match(bus_id.strip())
    if not match:
        return None
    domain = int(match["domain"] or "0", 16)
    return f"{domain:04x}:{int(match['bus'], 16):02x}:{int(match['dev'], 16):02x}.{int(match['fn'] or '0')}"


def recovery_action_from_message(message: str) -> str | None:
    """The action an Xid 154 message says it now requires, in :data:`RECOVERY_ACTIONS` words."""
    match = _RECOVERY_CHANGE.search(message)
    if match:
        return RECOVERY_ACTIONS.get(int(match["code"], 16), f"unknown_{int(match['code'], 16)}")
    tail = message.rsplit("(", 1)[-1].rstrip(" .)").lower() if "(" in message else ""
    return _RECOVERY_WORDS.get(tail)


def parse_xid_line(line: str, *, time_iso: str) -> schema.XidEvent | None:
    """One ``NVRM: Xid`` kernel-log line (raw, ``dmesg`` or ``/dev/kmsg`` form) as an event, else None."""
    match = _XID_LINE.search(line)
    if not match:
        return None
    xid = int(match["xid"])
    message = (match["rest"] or "").strip()[: schema.MAX_MESSAGE] or None
    return {
        "xid": xid,
        "gpu_index": None,
        "uuid": None,
        "pci_bus_id": normalize_bus_id(match["bus"]),
        "time": time_iso,
        "source": "kmsg",
        "message": message,
        "recovery_action": recovery_action_from_message(message) if xid == 154 and message else None,
    }


class KmsgReader:
    """Reads ``NVRM: Xid`` records from ``/dev/kmsg`` without blocking (or from any file of such lines).

    ``/dev/kmsg`` returns one record per read, ``prio,seq,usec,flags;text``; the timestamp is microseconds
    since boot, converted to wall time with the current monotonic clock. Reading it needs root or
    CAP_SYSLOG; :meth:`open` raises ``OSError`` otherwise.
    """

    def __init__(
        self,
        path: str = "/dev/kmsg",
        *,
        from_start: bool = True,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.from_start = from_start
        self._wall = wall_clock
        self._mono = monotonic
        self._fd: int | None = None
        self._partial = b""

    def open(self) -> None:
        self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        if not self.from_start:
            os.lseek(self._fd, 0, os.SEEK_END)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _time_of(self, header: str) -> str:
        fields = header.split(",")
        now = self._wall()
        if len(fields) >= 3 and fields[2].isdigit():
            return utc_iso(now - (self._mono() - int(fields[2]) / 1e6))
        return utc_iso(now)

    def poll(self, max_reads: int = 10_000) -> list[schema.XidEvent]:
        """Every Xid record that arrived since the last poll (bounded by ``max_reads`` reads)."""
        if self._fd is None:
            return []
        events: list[schema.XidEvent] = []
        for _ in range(max_reads):
            try:
                chunk = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:
                continue  # the ring buffer overwrote the record we were at; the next read resumes
            if not chunk:
                break
            data = self._partial + chunk
            *lines, self._partial = data.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                if line.startswith(" "):
                    continue  # kmsg continuation ("key=value") lines
                header, sep, text = line.partition(";")
                time_iso = self._time_of(header) if sep else utc_iso(self._wall())
                event = parse_xid_line(text if sep else line, time_iso=time_iso)
                if event is not None:
                    events.append(event)
        return events


class XidWatcher:
    """Waits for Xid events: NVML's event set where the driver offers it, else the kernel log."""

    def __init__(
        self,
        backend: NvmlBackend,
        *,
        kmsg: KmsgReader | None = None,
        use_kmsg: bool | None = None,
        wall_clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.backend = backend
        self.kmsg = kmsg if kmsg is not None else KmsgReader()
        self.use_kmsg = use_kmsg
        self.nvml_events = False
        self.kmsg_open = False
        self.problems: list[str] = []
        self._wall = wall_clock
        self._sleep = sleep

    def start(self) -> None:
        try:
            self.backend.register_xid_events()
            self.nvml_events = True
        except NvmlError as exc:
            self.problems.append(f"NVML Xid events unavailable ({exc}); falling back to the kernel log")
        if self.use_kmsg or (self.use_kmsg is None and not self.nvml_events):
            self._open_kmsg()

    def _open_kmsg(self) -> None:
        try:
            self.kmsg.open()
            self.kmsg_open = True
        except OSError as exc:
            self.problems.append(f"kernel log {self.kmsg.path} unreadable: {exc}")

    def stop(self) -> None:
        self.kmsg.close()
        self.kmsg_open = False

    def wait(self, timeout_s: float, max_events: int = schema.MAX_XID_EVENTS) -> list[schema.XidEvent]:
        """Block up to ``timeout_s`` for the first Xid, then return it with any already queued."""
        events: list[schema.XidEvent] = []
        if self.nvml_events:
            try:
                self._drain_nvml(events, int(timeout_s * 1000), max_events)
            except NvmlError as exc:
                # A failing event set (driver unloaded, GPU lost) must not turn the agent's loop into a
                # busy loop: note it, fall back to the kernel log, and sleep out this wait.
                self.nvml_events = False
                self.problems.append(f"NVML Xid wait failed ({exc}); falling back to the kernel log")
                if self.use_kmsg is not False and not self.kmsg_open:
                    self._open_kmsg()
                if timeout_s > 0:
                    self._sleep(timeout_s)
        elif timeout_s > 0:
            self._sleep(timeout_s)
        if self.kmsg_open:
            events.extend(self.kmsg.poll())
        return events[:max_events]

    def _drain_nvml(self, events: list[schema.XidEvent], wait_ms: int, max_events: int) -> None:
        while len(events) < max_events:
            raw = self.backend.wait_xid(wait_ms)
            if raw is None:
                return
            events.append(
                {
                    "xid": raw.xid,
                    "gpu_index": raw.gpu_index,
                    "uuid": None,
                    "pci_bus_id": None,
                    "time": utc_iso(self._wall()),
                    "source": "nvml",
                    "message": None,
                    "recovery_action": None,
                }
            )
            wait_ms = 0  # only drain what is already queued


class _GpuProbe:
    """Runs one GPU's getters, sorting failures into unsupported / errors / lost."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.unsupported: list[str] = []
        self.errors: list[str] = []
        self.lost = False

    def get(self, field: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        if self.lost:
            return None
        try:
            return fn(*args, **kwargs)
        except NvmlError as exc:
            if exc.unavailable:
                self.unsupported.append(field)
            else:
                self.lost = exc.code == ERROR_GPU_IS_LOST
                self.errors.append(f"{field}: {exc}"[: schema.MAX_STRING])
            return None


_CONTROL = dict.fromkeys([*range(0x20), *range(0x7F, 0xA0)])


def _s(value: str | None) -> str | None:
    """An NVML string as the server takes it: control characters dropped, bounded."""
    return None if value is None else value.translate(_CONTROL)[: schema.MAX_STRING]


def _nvlinks(nv: NvmlBackend, probe: _GpuProbe) -> list[schema.NvLinkSample]:
    links: list[schema.NvLinkSample] = []
    for link in range(NVLINK_MAX_LINKS):
        if probe.lost:
            break
        try:
            active: bool | None = nv.nvlink_active(probe.index, link)
        except NvmlError as exc:
            # The first link past the GPU's last answers INVALID_ARGUMENT; a link (or a whole GPU) without
            # NVLink answers NOT_SUPPORTED, and later links may still exist.
            if exc.code == ERROR_INVALID_ARGUMENT:
                break
            if exc.unavailable:
                continue
            probe.get(f"nvlink[{link}].state", _raise, exc)
            active = None
        counters = {
            name: probe.get(f"nvlink[{link}].{name}", nv.nvlink_error_counter, probe.index, link, number)
            for number, name in enumerate(NVLINK_COUNTERS)
        }
        links.append(
            {
                "link": link,
                "active": active,
                "replay": counters["replay"],
                "recovery": counters["recovery"],
                "crc_flit": counters["crc_flit"],
                "crc_data": counters["crc_data"],
                "ecc_data": counters["ecc_data"],
            }
        )
    if not links and not probe.lost:
        probe.unsupported.append("nvlink")
    # Per-link counters a driver does not keep would otherwise flood ``unsupported``.
    probe.unsupported = _collapse_nvlink_fields(probe.unsupported)
    return links


def _collapse_nvlink_fields(fields: list[str]) -> list[str]:
    out: list[str] = []
    for field in fields:
        name = "nvlink.counters" if field.startswith("nvlink[") else field
        if name not in out:
            out.append(name)
    return out


def _raise(exc: NvmlError) -> None:
    raise exc


def sample_gpu(nv: NvmlBackend, index: int) -> schema.GpuSample:
    """Every metric of one GPU the backend offers."""
    p = _GpuProbe(index)
    uuid = p.get("uuid", nv.uuid, index)
    name = p.get("name", nv.name, index)
    serial = p.get("serial", nv.serial, index)
    bus = p.get("pci_bus_id", nv.pci_bus_id, index)
    vbios = p.get("vbios_version", nv.vbios_version, index)
    temp = p.get("temperature", nv.temperature, index)
    slowdown = p.get("temperature_slowdown", nv.temperature_threshold, index, "slowdown")
    shutdown = p.get("temperature_shutdown", nv.temperature_threshold, index, "shutdown")
    power = p.get("power_draw", nv.power_usage_mw, index)
    limit = p.get("power_limit", nv.power_limit_mw, index)
    util = p.get("utilization", nv.utilization, index)
    mem = p.get("memory", nv.memory_info, index)
    ecc_mode = p.get("ecc_mode", nv.ecc_mode, index)
    ecc: schema.EccCounts = {
        "volatile_corrected": p.get(
            "ecc.volatile_corrected", nv.total_ecc_errors, index, uncorrected=False, aggregate=False
        ),
        "volatile_uncorrected": p.get(
            "ecc.volatile_uncorrected", nv.total_ecc_errors, index, uncorrected=True, aggregate=False
        ),
        "aggregate_corrected": p.get(
            "ecc.aggregate_corrected", nv.total_ecc_errors, index, uncorrected=False, aggregate=True
        ),
        "aggregate_uncorrected": p.get(
            "ecc.aggregate_uncorrected", nv.total_ecc_errors, index, uncorrected=True, aggregate=True
        ),
    }
    rows = p.get("remapped_rows", nv.remapped_rows, index)
    remapped: schema.RemappedRows | None = None
    if rows is not None:
        remapped = {
            "correctable": rows[0],
            "uncorrectable": rows[1],
            "pending": bool(rows[2]),
            "failure": bool(rows[3]),
        }
    retired: schema.RetiredPages | None = None
    single = p.get("retired_pages.single_bit", nv.retired_pages, index, double_bit=False)
    double = p.get("retired_pages.double_bit", nv.retired_pages, index, double_bit=True)
    pending = p.get("retired_pages.pending", nv.retired_pages_pending, index)
    if (single, double, pending) != (None, None, None):
        retired = {"single_bit": single, "double_bit": double, "pending": pending}
    reasons = p.get("clock_event_reasons", nv.clock_event_reasons, index)
    nvlinks = _nvlinks(nv, p)
    pcie: schema.PcieSample = {
        "replay_counter": p.get("pcie.replay_counter", nv.pcie_replay_counter, index),
        "gen_current": p.get("pcie.gen_current", nv.pcie_link_generation, index, maximum=False),
        "gen_max": p.get("pcie.gen_max", nv.pcie_link_generation, index, maximum=True),
        "width_current": p.get("pcie.width_current", nv.pcie_link_width, index, maximum=False),
        "width_max": p.get("pcie.width_max", nv.pcie_link_width, index, maximum=True),
    }
    action = p.get("recovery_action", nv.recovery_action, index)
    return {
        "index": index,
        "uuid": _s(uuid),
        "name": _s(name),
        "serial": _s(serial),
        "pci_bus_id": normalize_bus_id(bus) if bus else None,
        "vbios_version": _s(vbios),
        "lost": p.lost,
        "temperature_c": temp,
        "temperature_slowdown_c": slowdown,
        "temperature_shutdown_c": shutdown,
        "power_draw_w": None if power is None else round(power / 1000, 3),
        "power_limit_w": None if limit is None else round(limit / 1000, 3),
        "utilization_gpu_pct": None if util is None else util[0],
        "utilization_memory_pct": None if util is None else util[1],
        "memory_total_mib": None if mem is None else mem[0] // 1_048_576,
        "memory_used_mib": None if mem is None else mem[1] // 1_048_576,
        "ecc_enabled": None if ecc_mode is None else bool(ecc_mode[0]),
        "ecc": ecc,
        "remapped_rows": remapped,
        "retired_pages": retired,
        "clock_event_reasons": reasons,
        "clock_events": []
        if reasons is None
        else [n for bit, n in CLOCK_EVENT_REASONS.items() if reasons & bit],
        "nvlinks": nvlinks,
        "pcie": pcie,
        "recovery_action": None if action is None else RECOVERY_ACTIONS.get(action, f"unknown_{action}"),
        "unsupported": p.unsupported,
        "errors": p.errors,
    }


def _cuda_version(value: int) -> str:
    # NVML encodes CUDA 12.7 as 12070.
    return f"{value // 1000}.{(value % 1000) // 10}"


def _attach_gpus(events: Iterable[schema.XidEvent], gpus: list[schema.GpuSample]) -> list[schema.XidEvent]:
    """Fill each event's index/uuid/bus id from the GPU it names, and Xid 154's action from NVML."""
    by_index = {g["index"]: g for g in gpus}
    by_bus = {g["pci_bus_id"]: g for g in gpus if g["pci_bus_id"]}
    out: list[schema.XidEvent] = []
    for event in events:
        event = dict(event)  # type: ignore[assignment]
        gpu = by_index.get(event["gpu_index"]) if event["gpu_index"] is not None else None
        if gpu is None and event["pci_bus_id"]:
            gpu = by_bus.get(event["pci_bus_id"])
        if gpu is not None:
            event["gpu_index"] = gpu["index"]
            event["uuid"] = gpu["uuid"]
            event["pci_bus_id"] = gpu["pci_bus_id"]
            if event["xid"] == 154 and event["recovery_action"] is None:
                event["recovery_action"] = gpu["recovery_action"]
        out.append(event)
    return out


def collect(
    nv: NvmlBackend,
    expected_gpus: int | None = None,
    *,
    xid_events: Iterable[schema.XidEvent] = (),
    hostname: str | None = None,
    now: float | None = None,
) -> schema.Report:
    """One report of every GPU NVML shows (NVML already initialised), with the given Xid events."""
    errors: list[str] = []
    driver = cuda = None
    try:
        driver = nv.driver_version()
    except NvmlError as exc:
        errors.append(f"driver_version: {exc}")
    try:
        cuda = _cuda_version(nv.cuda_driver_version())
    except NvmlError as exc:
        errors.append(f"cuda_driver_version: {exc}")
    try:
        count = nv.device_count()
    except NvmlError as exc:
        errors.append(f"device_count: {exc}")
        count = 0
    gpus = [sample_gpu(nv, i) for i in range(min(count, schema.MAX_GPUS))]
    if count > schema.MAX_GPUS:
        errors.append(f"{count} GPUs; reporting the first {schema.MAX_GPUS}")
    events = _attach_gpus(xid_events, gpus)
    if len(events) > schema.MAX_XID_EVENTS:
        errors.append(f"{len(events)} Xid events; reporting the last {schema.MAX_XID_EVENTS}")
        events = events[-schema.MAX_XID_EVENTS :]
    return {
        "schema": schema.SCHEMA_VERSION,
        "agent_version": bcm.__version__,
        "hostname": (hostname or socket.gethostname())[: schema.MAX_STRING],
        "collected_at": utc_iso(time.time() if now is None else now),
        "driver_version": _s(driver),
        "cuda_driver_version": cuda,
        "gpu_count": count,
        "expected_gpu_count": expected_gpus,
        "gpus": gpus,
        "xid_events": events,
        "errors": [e[: schema.MAX_STRING] for e in errors[: schema.MAX_ERRORS]],
    }
