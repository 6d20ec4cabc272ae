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
    INTERRUPTED = "interrupted"  # its server stopped or died while it ran; per-node results kept
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
    # the server process running it, and when that process last said it is alive
    runner: str | None = Field(default=None, max_length=128, index=True)
    heartbeat_at: datetime | None = Field(default=None, sa_column=ts_column())


class OperationPublic(OperationBase):
    id: int
    results: dict[str, Any] | None = None
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


class OperationDetail(OperationPublic):
    log: str = ""
