"""Server-side validation of the agent's report (wire format defined in :mod:`bcm.agent.schema`).

Every list and string is bounded, counters are non-negative, and unknown fields are refused, so an
oversize or malformed report fails validation (HTTP 422) before it reaches the rules or the database.
The API should also cap the request body at :data:`MAX_REPORT_BYTES` before parsing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from bcm.agent.schema import (
    MAX_ERRORS,
    MAX_GPUS,
    MAX_MESSAGE,
    MAX_NVLINKS,
    MAX_REPORT_BYTES,
    MAX_STRING,
    MAX_XID_EVENTS,
    SCHEMA_VERSION,
)
from bcm.domain.bounds import INT32_MAX, INT64_MAX, Timestamp

__all__ = ["MAX_REPORT_BYTES", "HealthReport", "GpuSampleIn", "XidEventIn"]

Str = Annotated[str, Field(max_length=MAX_STRING)]
Count = Annotated[int, Field(ge=0, le=2**64 - 1)]  # NVML's unsigned long long; judged, never stored
# what is stored goes into a column: BIGINT counters, INTEGER sizes, strings of the column's length
Count64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
Mib = Annotated[int, Field(ge=0, le=INT32_MAX)]
Index = Annotated[int, Field(ge=0, lt=MAX_GPUS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EccCountsIn(_Strict):
    volatile_corrected: Count64 | None = None
    volatile_uncorrected: Count64 | None = None
    aggregate_corrected: Count64 | None = None
    aggregate_uncorrected: Count64 | None = None


class RemappedRowsIn(_Strict):
    correctable: Count64
    uncorrectable: Count64
    pending: bool
    failure: bool


class RetiredPagesIn(_Strict):
    single_bit: Count64 | None = None
    double_bit: Count64 | None = None
    pending: bool | None = None


class NvLinkIn(_Strict):
    link: Annotated[int, Field(ge=0, lt=MAX_NVLINKS)]
    active: bool | None = None
    replay: Count | None = None
    recovery: Count | None = None
    crc_flit: Count | None = None
    crc_data: Count | None = None
    ecc_data: Count | None = None


class PcieIn(_Strict):
    replay_counter: Count64 | None = None
    gen_current: Annotated[int, Field(ge=0, le=32)] | None = None
    gen_max: Annotated[int, Field(ge=0, le=32)] | None = None
    width_current: Annotated[int, Field(ge=0, le=64)] | None = None
    width_max: Annotated[int, Field(ge=0, le=64)] | None = None


class GpuSampleIn(_Strict):
    index: Index
    uuid: Annotated[str, Field(max_length=96)] | None = None
    name: Annotated[str, Field(max_length=128)] | None = None
    serial: Str | None = None
    pci_bus_id: Annotated[str, Field(max_length=32)] | None = None
    vbios_version: Str | None = None
    lost: bool = False
    temperature_c: Annotated[int, Field(ge=-100, le=300)] | None = None
    temperature_slowdown_c: Annotated[int, Field(ge=-100, le=300)] | None = None
    temperature_shutdown_c: Annotated[int, Field(ge=-100, le=300)] | None = None
    power_draw_w: Annotated[float, Field(ge=0, le=100_000)] | None = None
    power_limit_w: Annotated[float, Field(ge=0, le=100_000)] | None = None
    utilization_gpu_pct: Annotated[int, Field(ge=0, le=100)] | None = None
    utilization_memory_pct: Annotated[int, Field(ge=0, le=100)] | None = None
    memory_total_mib: Mib | None = None
    memory_used_mib: Mib | None = None
    ecc_enabled: bool | None = None
    ecc: EccCountsIn = EccCountsIn()
    remapped_rows: RemappedRowsIn | None = None
    retired_pages: RetiredPagesIn | None = None
    clock_event_reasons: Count | None = None
    clock_events: Annotated[list[Str], Field(max_length=64)] = []
    nvlinks: Annotated[list[NvLinkIn], Field(max_length=MAX_NVLINKS)] = []
    pcie: PcieIn = PcieIn()
    recovery_action: Str | None = None
    unsupported: Annotated[list[Str], Field(max_length=128)] = []
    errors: Annotated[list[Str], Field(max_length=MAX_ERRORS)] = []


class XidEventIn(_Strict):
    xid: Annotated[int, Field(ge=0, le=65_535)]
    gpu_index: Index | None = None
    uuid: Str | None = None
    pci_bus_id: Str | None = None
    time: Timestamp
    source: Literal["nvml", "kmsg"]
    message: Annotated[str, Field(max_length=MAX_MESSAGE)] | None = None
    recovery_action: Str | None = None


class HealthReport(_Strict):
    """One agent report, validated; ``model_dump()`` is what :func:`bcm.domain.health.evaluate` takes."""

    # "schema" shadows a deprecated BaseModel attribute, hence the alias.
    schema_version: Literal[1] = Field(alias="schema")
    agent_version: Annotated[str, Field(max_length=64)]
    hostname: Str
    collected_at: Timestamp
    driver_version: Annotated[str, Field(max_length=64)] | None = None
    cuda_driver_version: Str | None = None
    gpu_count: Annotated[int, Field(ge=0, le=1024)]
    expected_gpu_count: Annotated[int, Field(ge=0, le=1024)] | None = None
    gpus: Annotated[list[GpuSampleIn], Field(max_length=MAX_GPUS)]
    xid_events: Annotated[list[XidEventIn], Field(max_length=MAX_XID_EVENTS)] = []
    errors: Annotated[list[Str], Field(max_length=MAX_ERRORS)] = []

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    def rules_input(self) -> dict[str, Any]:
        """The plain dict the health rules read (wire names, JSON types)."""
        return self.model_dump(mode="json", by_alias=True)


assert SCHEMA_VERSION == 1, "HealthReport.schema_version must follow bcm.agent.schema.SCHEMA_VERSION"
