"""Audit events: who did what to which object."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlmodel import Field, SQLModel

from bcm.models.base import json_column, ts_column, utcnow


class EventBase(SQLModel):
    actor: str = Field(max_length=128)
    action: str = Field(max_length=64, index=True)
    target: str = Field(default="", max_length=4096)
    severity: str = Field(default="info", max_length=16)
    message: str = Field(default="", max_length=4096)


class Event(EventBase, table=True):
    id: int | None = Field(default=None, primary_key=True)
    time: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False, index=True))
    detail: dict[str, Any] | None = Field(default=None, sa_column=json_column())


class EventPublic(EventBase):
    id: int
    time: datetime
    detail: dict[str, Any] | None = None
