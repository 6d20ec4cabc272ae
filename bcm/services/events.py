"""The audit log: record and query who did what."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlmodel import Session, col, select

from bcm.models.event import Event


def record(
    session: Session,
    actor: str,
    action: str,
    target: str = "",
    message: str = "",
    *,
    severity: str = "info",
    detail: dict[str, Any] | None = None,
) -> Event:
    event = Event(
        actor=actor,
        action=action,
        target=target[:4096],
        message=message[:4096],
        severity=severity,
        detail=detail,
    )
    session.add(event)
    return event


def query(
    session: Session,
    *,
    since: datetime | None = None,
    action: str | None = None,
    target: str | None = None,
    limit: int = 100,
    offset: int = 0,
) -> list[Event]:
    stmt = select(Event)
    if since is not None:
        stmt = stmt.where(col(Event.time) >= since)
    if action:
        stmt = stmt.where(Event.action == action)
    if target:
        stmt = stmt.where(col(Event.target).contains(target))
    stmt = stmt.order_by(col(Event.id).desc()).offset(offset).limit(limit)
    return list(session.exec(stmt))
