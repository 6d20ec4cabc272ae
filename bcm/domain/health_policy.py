"""A category's health policy: the typed, bounded form of the overrides :class:`Thresholds` takes.

Unknown keys and wrong types are refused (422 naming the key) when a category is written, so a stored
policy can always be applied to a report. Numbers are bounded by what the rules can compare against.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from bcm.agent.nvml import CLOCK_EVENT_REASONS
from bcm.domain.health import Action, Verdict

Counter = Annotated[StrictInt, Field(ge=0, le=2**63 - 1)]
Celsius = Annotated[StrictInt, Field(ge=-100, le=300)]
ClockEvent = Annotated[str, Field(max_length=64)]
KNOWN_CLOCK_EVENTS = frozenset(CLOCK_EVENT_REASONS.values())


class XidOverride(BaseModel):
    model_config = ConfigDict(extra="forbid")

    severity: Verdict
    action: Action


class HealthPolicy(BaseModel):
    """Every threshold a category may override; all optional, nothing else accepted."""

    model_config = ConfigDict(extra="forbid")

    ecc_uncorrected_max: Counter | None = None
    ecc_corrected_warn: Counter | None = None
    retired_pages_max: Counter | None = None
    temperature_margin_c: Annotated[StrictInt, Field(ge=0, le=200)] | None = None
    temperature_warn_c: Celsius | None = None
    pcie_check_generation: StrictBool | None = None
    pcie_replay_warn: Counter | None = None
    nvlink_error_warn: Counter | None = None
    nvlink_inactive_warn: StrictBool | None = None
    clock_events_warn: Annotated[list[ClockEvent], Field(max_length=len(KNOWN_CLOCK_EVENTS))] | None = None
    stale_intervals: Annotated[StrictInt, Field(ge=1, le=1000)] | None = None
    xid_overrides: Annotated[dict[str, XidOverride], Field(max_length=256)] | None = None

    @field_validator("clock_events_warn")
    @classmethod
    def _known_events(cls, v: list[str] | None) -> list[str] | None:
        for name in v or ():
            if name not in KNOWN_CLOCK_EVENTS:
                raise ValueError(
                    f"unknown clock event {name!r}; known: {', '.join(sorted(KNOWN_CLOCK_EVENTS))}"
                )
        return v

    @field_validator("xid_overrides")
    @classmethod
    def _xid_keys(cls, v: dict[str, XidOverride] | None) -> dict[str, XidOverride] | None:
        for key in v or {}:
            if not key.isdigit() or not 0 <= int(key) <= 65535:
                raise ValueError(f"Xid {key!r} is not a number from 0 to 65535")
        return v

    def stored(self) -> dict[str, Any]:
        """The JSON kept in the category row: only what was set, nulls meaning "use the default" dropped."""
        return self.model_dump(mode="json", exclude_none=True)
