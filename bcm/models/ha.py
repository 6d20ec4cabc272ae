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


class ServerStatus(SQLModel):
    """One server as ``GET /api/v1/ha`` shows it."""

    id: str
    address: str
    version: str
    started_at: datetime
    heartbeat_at: datetime
    alive: bool  # heard from within three leases
    leader: bool
    operations: int  # open operations it holds


class LeaseStatus(SQLModel):
    holder: str | None = None
    epoch: int = 0
    acquired_at: datetime | None = None
    expires_at: datetime | None = None
    address: str | None = None  # the holder's API address


class HeldOperation(SQLModel):
    id: int
    kind: str
    state: str
    owner: str | None = None
    lease_expires: datetime | None = None


class ThisServer(SQLModel):
    """The answering server's own view (its election loop)."""

    id: str
    address: str
    leading: bool
    epoch: int | None = None
    lease_s: float
    refused_writes: int = 0  # leader-work transactions refused by the fence in this process


class HaStatus(SQLModel):
    now: datetime
    this_server: ThisServer | None = None
    leader: LeaseStatus
    servers: list[ServerStatus]
    operations: list[HeldOperation]
