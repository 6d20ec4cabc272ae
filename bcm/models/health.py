"""GPU health: latest state per GPU and per node, a bounded sample history, and health events.

``GpuHealth`` and ``NodeHealth`` hold one row each, overwritten by every report (the summary and
``/metrics`` read only these). ``HealthRecord`` is the history, one row per report, pruned to
``settings.health.history_per_gpu`` reports per node. ``HealthEvent`` records what changed: verdict
changes, Xid events, drains and resumes.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Index, Integer
from sqlmodel import Column, Field, SQLModel

from bcm.models.base import json_column, ts_column, utcnow

# SQLite autoincrements only an INTEGER PRIMARY KEY; PostgreSQL needs 64 bits for a long-lived history.
BigId = BigInteger().with_variant(Integer(), "sqlite")


# Rows every report updates: half of each page left free, so an update that changes no indexed column
# stays on its page and writes no index entry (PostgreSQL's heap-only tuples; migration 0011).
UPDATED_IN_PLACE = {"fillfactor": 50}


class NodeHealth(SQLModel, table=True):
    """A node's health: the effective verdict (a FAIL holds until the node has recovered) and drain state."""

    __table_args__ = {"postgresql_with": UPDATED_IN_PLACE}

    node_id: int = Field(primary_key=True, foreign_key="node.id", ondelete="CASCADE")
    verdict: str = Field(default="UNKNOWN", max_length=16, index=True)
    report_verdict: str | None = Field(default=None, max_length=16)  # what the last report alone said
    last_report_at: datetime | None = Field(default=None, sa_column=ts_column())  # unindexed: see 0011
    collected_at: datetime | None = Field(default=None, sa_column=ts_column())
    consecutive_ok: int = 0
    gpu_count: int = 0
    agent_version: str | None = Field(default=None, max_length=64)
    driver_version: str | None = Field(default=None, max_length=64)
    findings: list[dict[str, Any]] | None = Field(default=None, sa_column=json_column())
    drained_by_bcm: bool = False
    drain_reason: str | None = Field(default=None, max_length=512)
    pending_action: str | None = Field(default=None, max_length=16, index=True)  # drain | resume
    action_attempts: int = 0
    samples_since_prune: int = 0
    updated_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))


class GpuHealth(SQLModel, table=True):
    """The latest sample and verdict of one GPU, keyed by its node and index (UUID indexed)."""

    __table_args__ = {"postgresql_with": UPDATED_IN_PLACE}

    node_id: int = Field(primary_key=True, foreign_key="node.id", ondelete="CASCADE")
    index: int = Field(primary_key=True)
    uuid: str = Field(max_length=96, index=True)
    name: str | None = Field(default=None, max_length=128)
    pci_bus_id: str | None = Field(default=None, max_length=32)
    verdict: str = Field(default="UNKNOWN", max_length=16, index=True)
    reasons: list[dict[str, Any]] | None = Field(default=None, sa_column=json_column())
    temperature_c: int | None = None
    power_draw_w: float | None = None
    utilization_gpu_pct: int | None = None
    utilization_memory_pct: int | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    ecc_sbe_volatile: int | None = Field(default=None, sa_column=Column(BigInteger))
    ecc_dbe_volatile: int | None = Field(default=None, sa_column=Column(BigInteger))
    ecc_sbe_aggregate: int | None = Field(default=None, sa_column=Column(BigInteger))
    ecc_dbe_aggregate: int | None = Field(default=None, sa_column=Column(BigInteger))
    pcie_replay: int | None = Field(default=None, sa_column=Column(BigInteger))
    remap_correctable: int | None = Field(default=None, sa_column=Column(BigInteger))
    remap_uncorrectable: int | None = Field(default=None, sa_column=Column(BigInteger))
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    retired_sbe: int | None = Field(default=None, sa_column=Column(BigInteger))
    retired_dbe: int | None = Field(default=None, sa_column=Column(BigInteger))
    retired_pending: bool | None = None
    last_xid: int | None = None
    xid_count: int = 0
    sampled_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))


# What one GPU's reading in a HealthRecord holds, in this order (a list per GPU keeps the row small).
RECORD_FIELDS = (
    "index",
    "uuid",
    "verdict",
    "temperature_c",
    "power_draw_w",
    "utilization_gpu_pct",
    "memory_used_mib",
    "ecc_sbe_volatile",
    "ecc_dbe_volatile",
    "xid",
)


class HealthRecord(SQLModel, table=True):
    """One report's GPU readings (the bounded history): one row per report, whatever its GPU count.

    ``gpus`` holds one list per GPU, its values in :data:`RECORD_FIELDS` order (migration 0012: one row
    with eight readings costs the database a sixth of eight rows).
    """

    __table_args__ = (Index("ix_healthrecord_node_id_id", "node_id", "id"),)

    id: int | None = Field(default=None, sa_column=Column(BigId, primary_key=True, autoincrement=True))
    node_id: int = Field(
        foreign_key="node.id", ondelete="CASCADE"
    )  # ix_healthrecord_node_id_id leads with it
    time: datetime = Field(sa_column=ts_column(nullable=False))
    gpus: list[list[Any]] = Field(sa_column=json_column(nullable=False))


class HealthEvent(SQLModel, table=True):
    """Something worth a person's attention: a verdict change, an Xid, a drain or a resume."""

    __table_args__ = (Index("ix_healthevent_node_id_id", "node_id", "id"),)

    id: int | None = Field(default=None, sa_column=Column(BigId, primary_key=True, autoincrement=True))
    time: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False, index=True))
    node_id: int = Field(foreign_key="node.id", index=True, ondelete="CASCADE")
    gpu_uuid: str | None = Field(default=None, max_length=96)
    gpu_index: int | None = None
    severity: str = Field(max_length=16, index=True)
    code: str = Field(max_length=64)
    message: str = Field(default="", max_length=1024)
    action: str | None = Field(default=None, max_length=32)


# --- API schemas ---------------------------------------------------------------------------------


class HealthSummary(SQLModel):
    nodes: int
    nodes_by_verdict: dict[str, int]
    nodes_never_reported: int
    nodes_stale: int
    nodes_drained_by_bcm: int
    gpus: int
    gpus_by_verdict: dict[str, int]
    failing: list[str]  # up to 100 names of nodes whose verdict is FAIL
    interval_s: float
    generated_at: datetime


class NodeHealthPublic(SQLModel):
    name: str
    verdict: str
    report_verdict: str | None
    last_report_at: datetime | None
    stale: bool
    consecutive_ok: int
    gpu_count: int
    drained_by_bcm: bool
    drain_reason: str | None
    provision_state: str
    findings: list[dict[str, Any]]


class NodeHealthPage(SQLModel):
    items: list[NodeHealthPublic]
    total: int
    limit: int
    offset: int


class GpuHealthPublic(SQLModel):
    node: str
    index: int
    uuid: str
    name: str | None
    pci_bus_id: str | None
    verdict: str
    reasons: list[dict[str, Any]]
    temperature_c: int | None
    power_draw_w: float | None
    utilization_gpu_pct: int | None
    memory_total_mib: int | None
    memory_used_mib: int | None
    ecc_sbe_volatile: int | None
    ecc_dbe_volatile: int | None
    last_xid: int | None
    xid_count: int
    sampled_at: datetime


class HealthSamplePublic(SQLModel):
    time: datetime
    verdict: str
    temperature_c: int | None
    power_draw_w: float | None
    utilization_gpu_pct: int | None
    memory_used_mib: int | None
    ecc_sbe_volatile: int | None
    ecc_dbe_volatile: int | None
    xid: int | None


class GpuHistory(SQLModel):
    uuid: str
    node: str | None
    index: int | None
    samples: list[HealthSamplePublic]


class HealthEventPublic(SQLModel):
    id: int
    time: datetime
    node: str
    gpu_uuid: str | None
    gpu_index: int | None
    severity: str
    code: str
    message: str
    action: str | None


class ReportAccepted(SQLModel):
    node: str
    verdict: str
    report_verdict: str
    action: str | None = None
