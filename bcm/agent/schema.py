"""The agent's report wire format (JSON), as typed dicts, with the bounds both sides enforce.

The agent runs on nodes with only python3, so this module is stdlib only; the server validates the same
shape with pydantic in :mod:`bcm.domain.health_report`. ``None`` always means "not offered by this GPU
or driver" (NVML answered NOT_SUPPORTED), never zero.

Example (abridged)::

    {"schema": 1, "agent_version": "0.1.0", "hostname": "gpu01", "collected_at": "2024-11-14T07:00:14Z",
     "driver_version": "565.57.01", "cuda_driver_version": "12.7", "gpu_count": 8, "expected_gpu_count": 8,
     "gpus": [{"index": 0, "uuid": "GPU-b42d…", "temperature_c": 30, "remapped_rows": {...}, ...}],
     "xid_events": [{"xid": 79, "gpu_index": 0, "source": "nvml", ...}], "errors": []}
"""

from __future__ import annotations

from typing import Literal, TypedDict

SCHEMA_VERSION = 1

# Bounds on one report; the server answers 422 beyond them and the agent trims to them before sending.
# Strings hold no control characters (C0, DEL, C1); messages and errors may keep newlines and tabs.
MAX_GPUS = 64
MAX_NVLINKS = 36
MAX_XID_EVENTS = 256
MAX_ERRORS = 64
MAX_STRING = 256
MAX_MESSAGE = 1024
MAX_REPORT_BYTES = 1_048_576

XidSource = Literal["nvml", "kmsg"]


class EccCounts(TypedDict):
    volatile_corrected: int | None
    volatile_uncorrected: int | None
    aggregate_corrected: int | None
    aggregate_uncorrected: int | None


class RemappedRows(TypedDict):
    correctable: int
    uncorrectable: int
    pending: bool
    failure: bool


class RetiredPages(TypedDict):
    single_bit: int | None
    double_bit: int | None
    pending: bool | None


class NvLinkSample(TypedDict):
    link: int
    active: bool | None
    replay: int | None
    recovery: int | None
    crc_flit: int | None
    crc_data: int | None
    ecc_data: int | None


class PcieSample(TypedDict):
    replay_counter: int | None
    gen_current: int | None
    gen_max: int | None
    width_current: int | None
    width_max: int | None


class GpuSample(TypedDict):
    index: int
    uuid: str | None
    name: str | None
    serial: str | None
    pci_bus_id: str | None
    vbios_version: str | None
    lost: bool
    temperature_c: int | None
    temperature_slowdown_c: int | None
    temperature_shutdown_c: int | None
    power_draw_w: float | None
    power_limit_w: float | None
    utilization_gpu_pct: int | None
    utilization_memory_pct: int | None
    memory_total_mib: int | None
    memory_used_mib: int | None
    ecc_enabled: bool | None
    ecc: EccCounts
    remapped_rows: RemappedRows | None
    retired_pages: RetiredPages | None
    clock_event_reasons: int | None
    clock_events: list[str]
    nvlinks: list[NvLinkSample]
    pcie: PcieSample
    recovery_action: str | None
    unsupported: list[str]
    errors: list[str]


class XidEvent(TypedDict):
    xid: int
    gpu_index: int | None
    uuid: str | None
    pci_bus_id: str | None
    time: str
    source: XidSource
    message: str | None
    recovery_action: str | None


class Report(TypedDict):
    schema: int
    agent_version: str
    hostname: str
    collected_at: str
    driver_version: str | None
    cuda_driver_version: str | None
    gpu_count: int
    expected_gpu_count: int | None
    gpus: list[GpuSample]
    xid_events: list[XidEvent]
    errors: list[str]
