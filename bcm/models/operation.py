"""Operations: any long job (inventory, build, push, deploy) with progress and per-node results."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import Text
from sqlmodel import Column, Field, SQLModel

from bcm.models.base import json_column, ts_column, utcnow


class OpState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    PARTIAL = "partial"
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # (before leases) its server stopped while it ran; per-node results kept
    CANCELLED = "cancelled"  # stopped on request (`bcm op cancel`)

    @property
    def finished(self) -> bool:
        return self not in (OpState.PENDING, OpState.RUNNING)


class OperationBase(SQLModel):
    kind: str = Field(max_length=32, index=True)
    targets: str = Field(default="", max_length=65535)  # folded hostlist
    state: str = Field(default=OpState.PENDING, max_length=16, index=True)
    progress_done: int = 0
    progress_total: int = 0
    created_by: str | None = Field(default=None, max_length=128)
    error: str | None = Field(default=None, max_length=4096)


class Operation(OperationBase, table=True):
    id: int | None = Field(default=None, primary_key=True)
    results: dict[str, Any] | None = Field(default=None, sa_column=json_column())
    log: str = Field(default="", sa_column=Column(Text, nullable=False, default=""))
    created_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False, index=True))
    started_at: datetime | None = Field(default=None, sa_column=ts_column())
    finished_at: datetime | None = Field(default=None, sa_column=ts_column())
    # the lease: the server running it (bcm.workers.identity.server_id) until ``lease_expires``; an open
    # operation whose lease has lapsed (or that has no owner) is claimed by the next server that looks
    owner: str | None = Field(default=None, max_length=128, index=True)
    lease_expires: datetime | None = Field(default=None, sa_column=ts_column())
    claims: int = 0  # how many times a server took it up: 1 for a first run, more once reclaimed
    # what its handler needs to run it again on another server (never a secret), and what it produced
    # beyond per-node results (the tenancy plan it applied …)
    spec: dict[str, Any] | None = Field(default=None, sa_column=json_column())
    outcome: dict[str, Any] | None = Field(default=None, sa_column=json_column())


class OperationPublic(OperationBase):
    id: int
    results: dict[str, Any] | None = None
    outcome: dict[str, Any] | None = None
    owner: str | None = None
    lease_expires: datetime | None = None
    claims: int = 0
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


class OperationDetail(OperationPublic):
    log: str = ""
