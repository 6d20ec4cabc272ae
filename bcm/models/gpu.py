"""GPUs found on nodes (one row per physical GPU, keyed by UUID)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import UniqueConstraint
from sqlmodel import Field, SQLModel

from bcm.models.base import ts_column, utcnow


class GpuBase(SQLModel):
    index: int
    uuid: str = Field(max_length=96)
    name: str | None = Field(default=None, max_length=128)
    memory_mib: int | None = None
    serial: str | None = Field(default=None, max_length=64)
    pci_bus_id: str | None = Field(default=None, max_length=32)
    driver_version: str | None = Field(default=None, max_length=32)
    vbios_version: str | None = Field(default=None, max_length=64)


class Gpu(GpuBase, table=True):
    __table_args__ = (UniqueConstraint("node_id", "index"),)

    id: int | None = Field(default=None, primary_key=True)
    node_id: int = Field(foreign_key="node.id", index=True, ondelete="CASCADE")
    uuid: str = Field(max_length=96, unique=True, index=True)
    verdict: str | None = Field(default=None, max_length=16)
    updated_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))


class GpuPublic(GpuBase):
    verdict: str | None = None
