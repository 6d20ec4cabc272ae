"""Several servers on one database: each server's heartbeat row, and the one leader lease row.

The lease row (``leader``, always ``id = 1``) says who leads until when, and the fencing ``epoch``:
taking the lease over adds one, so a write stamped with an older epoch is refused
(:func:`bcm.workers.leader.fence`).
"""

from __future__ import annotations

from datetime import datetime

from sqlmodel import Field, SQLModel

from bcm.models.base import ts_column, utcnow

LEASE_ROW = 1


class Server(SQLModel, table=True):
    """A running ``bcm serve`` (id: ``hostname:pid:random``), refreshed every renewal."""

    id: str = Field(primary_key=True, max_length=128)
    address: str = Field(default="", max_length=256)  # where its API answers (host:port)
    version: str = Field(default="", max_length=64)
    started_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))
    heartbeat_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False, index=True))


class Leader(SQLModel, table=True):
    """The leader lease: one row; ``holder`` None or past ``expires_at`` means anyone may take it."""

    id: int = Field(default=LEASE_ROW, primary_key=True)
    holder: str | None = Field(default=None, max_length=128)
    epoch: int = Field(default=0)
    acquired_at: datetime | None = Field(default=None, sa_column=ts_column())
    expires_at: datetime | None = Field(default=None, sa_column=ts_column())
