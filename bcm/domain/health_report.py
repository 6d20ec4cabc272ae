"""Server-side validation of the agent's report (wire format defined in :mod:`bcm.agent.schema`).

Every list and string is bounded, counters are non-negative, and unknown fields are refused, so an
oversize or malformed report fails validation (HTTP 422) before it reaches the rules or the database.
Strings hold no control characters (NUL no PostgreSQL text can hold; escape sequences would reach an
admin's terminal); free text (messages, errors) may keep newlines and tabs. The check is a pattern,
run in pydantic's core like the bounds, not a Python validator per string.
The API should also cap the request body at :data:`MAX_REPORT_BYTES` before parsing.

A GPU sample is validated into a plain dict (typed dicts with pydantic's bounds), which is what the
health rules read: the bulk of a report (eight GPUs of 18 NVLinks each) is then neither built as model
objects nor dumped back into dicts for the rules. A key the agent left out is absent (the rules and the
row builders read it as None), where a model would have filled in its default.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import BaseModel, ConfigDict, Field, with_config
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

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

# C0 controls, DEL and C1 controls are refused; a message may keep its newlines and tabs
_NO_CONTROL = r"^[^\x00-\x1f\x7f-\x9f]*$"
_NO_CONTROL_BUT_LINES = r"^[^\x00-\x08\x0b-\x1f\x7f-\x9f]*$"
Str = Annotated[str, Field(max_length=MAX_STRING, pattern=_NO_CONTROL)]
Text = Annotated[str, Field(max_length=MAX_STRING, pattern=_NO_CONTROL_BUT_LINES)]
Message = Annotated[str, Field(max_length=MAX_MESSAGE, pattern=_NO_CONTROL_BUT_LINES)]
Count = Annotated[int, Field(ge=0, le=2**64 - 1)]  # NVML's unsigned long long; judged, never stored
# what is stored goes into a column: BIGINT counters, INTEGER sizes, strings of the column's length
Count64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
Mib = Annotated[int, Field(ge=0, le=INT32_MAX)]
Index = Annotated[int, Field(ge=0, lt=MAX_GPUS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_FORBID = ConfigDict(extra="forbid")


@with_config(_FORBID)
class EccCountsIn(TypedDict, total=False):
    volatile_corrected: Count64 | None
    volatile_uncorrected: Count64 | None
    aggregate_corrected: Count64 | None
    aggregate_uncorrected: Count64 | None


@with_config(_FORBID)
class RemappedRowsIn(TypedDict):
    correctable: Count64
    uncorrectable: Count64
    pending: bool
    failure: bool


@with_config(_FORBID)
class RetiredPagesIn(TypedDict, total=False):
    single_bit: Count64 | None
    double_bit: Count64 | None
    pending: bool | None


@with_config(_FORBID)
class NvLinkIn(TypedDict):
    link: Annotated[int, Field(ge=0, lt=MAX_NVLINKS)]
    active: NotRequired[bool | None]
    replay: NotRequired[Count | None]
    recovery: NotRequired[Count | None]
    crc_flit: NotRequired[Count | None]
    crc_data: NotRequired[Count | None]
    ecc_data: NotRequired[Count | None]


@with_config(_FORBID)
class PcieIn(TypedDict, total=False):
    replay_counter: Count64 | None
    gen_current: Annotated[int, Field(ge=0, le=32)] | None
    gen_max: Annotated[int, Field(ge=0, le=32)] | None
    width_current: Annotated[int, Field(ge=0, le=64)] | None
    width_max: Annotated[int, Field(ge=0, le=64)] | None


@with_config(_FORBID)
class GpuSampleIn(TypedDict):
    index: Index
    uuid: NotRequired[Annotated[str, Field(max_length=96, pattern=_NO_CONTROL)] | None]
    name: NotRequired[Annotated[str, Field(max_length=128, pattern=_NO_CONTROL)] | None]
    serial: NotRequired[Str | None]
    pci_bus_id: NotRequired[Annotated[str, Field(max_length=32, pattern=_NO_CONTROL)] | None]
    vbios_version: NotRequired[Str | None]
    lost: NotRequired[bool]
    temperature_c: NotRequired[Annotated[int, Field(ge=-100, le=300)] | None]
    temperature_slowdown_c: NotRequired[Annotated[int, Field(ge=-100, le=300)] | None]
    temperature_shutdown_c: NotRequired[Annotated[int, Field(ge=-100, le=300)] | None]
    power_draw_w: NotRequired[Annotated[float, Field(ge=0, le=100_000)] | None]
    power_limit_w: NotRequired[Annotated[float, Field(ge=0, le=100_000)] | None]
    utilization_gpu_pct: NotRequired[Annotated[int, Field(ge=0, le=100)] | None]
    utilization_memory_pct: NotRequired[Annotated[int, Field(ge=0, le=100)] | None]
    memory_total_mib: NotRequired[Mib | None]
    memory_used_mib: NotRequired[Mib | None]
    ecc_enabled: NotRequired[bool | None]
    ecc: NotRequired[EccCountsIn]
    remapped_rows: NotRequired[RemappedRowsIn | None]
    retired_pages: NotRequired[RetiredPagesIn | None]
    clock_event_reasons: NotRequired[Count | None]
    clock_events: NotRequired[Annotated[list[Str], Field(max_length=64)]]
    nvlinks: NotRequired[Annotated[list[NvLinkIn], Field(max_length=MAX_NVLINKS)]]
    pcie: NotRequired[PcieIn]
    recovery_action: NotRequired[Str | None]
    unsupported: NotRequired[Annotated[list[Str], Field(max_length=128)]]
    errors: NotRequired[Annotated[list[Text], Field(max_length=MAX_ERRORS)]]


class XidEventIn(_Strict):
    xid: Annotated[int, Field(ge=0, le=65_535)]
    gpu_index: Index | None = None
    uuid: Str | None = None
    pci_bus_id: Str | None = None
    time: Timestamp
    source: Literal["nvml", "kmsg"]
    message: Message | None = None
    recovery_action: Str | None = None


class HealthReport(_Strict):
    """One agent report, validated; :meth:`rules_input` is what :func:`bcm.domain.health.evaluate` takes."""

    # "schema" shadows a deprecated BaseModel attribute, hence the alias.
    schema_version: Literal[1] = Field(alias="schema")
    agent_version: Annotated[str, Field(max_length=64, pattern=_NO_CONTROL)]
    hostname: Str
    collected_at: Timestamp
    driver_version: Annotated[str, Field(max_length=64, pattern=_NO_CONTROL)] | None = None
    cuda_driver_version: Str | None = None
    gpu_count: Annotated[int, Field(ge=0, le=1024)]
    expected_gpu_count: Annotated[int, Field(ge=0, le=1024)] | None = None
    gpus: Annotated[list[GpuSampleIn], Field(max_length=MAX_GPUS)]
    xid_events: Annotated[list[XidEventIn], Field(max_length=MAX_XID_EVENTS)] = []
    errors: Annotated[list[Text], Field(max_length=MAX_ERRORS)] = []

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    def rules_input(self) -> dict[str, Any]:
        """The plain dict the health rules read (wire names, JSON types); the GPU samples as validated."""
        out = self.model_dump(mode="json", by_alias=True, exclude={"gpus"})
        out["gpus"] = self.gpus
        return out


assert SCHEMA_VERSION == 1, "HealthReport.schema_version must follow bcm.agent.schema.SCHEMA_VERSION"
