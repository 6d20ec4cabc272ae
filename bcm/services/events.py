"""The audit log: record and query who did what."""

from __future__ import annotations

import threading
import time
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


class _Throttle:
    """What unauthenticated clients make bcm write is bounded: per (action, client address) one event a
    window; the refusals in between are counted and written as one summary event when the window closes
    (at that client's next refusal, or by :func:`flush_throttled`). Memory is bounded too."""

    def __init__(self, window_s: float = 60.0, max_keys: int = 10_000) -> None:
        self.window_s, self.max_keys = window_s, max_keys
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, str], list[Any]] = {}  # key -> [start, suppressed, target, actor]

    def admit(self, key: tuple[str, str], target: str, actor: str, now: float) -> tuple[bool, int]:
        """(write this one?, refusals suppressed in the window that just closed)."""
        with self._lock:
            w = self._windows.get(key)
            if w is not None and now - w[0] < self.window_s:
                w[1] += 1
                return False, 0
            closed = w[1] if w is not None else 0
            if w is None and len(self._windows) >= self.max_keys:
                self._windows.pop(next(iter(self._windows)))
            self._windows[key] = [now, 0, target, actor]
            return True, closed

    def closed(self, now: float) -> list[tuple[tuple[str, str], int, str, str]]:
        with self._lock:
            done = [(k, w[1], w[2], w[3]) for k, w in self._windows.items() if now - w[0] >= self.window_s]
            for k, *_ in done:
                del self._windows[k]
        return [d for d in done if d[1] > 0]


_throttle = _Throttle()


def record_unauthenticated(
    session: Session,
    actor: str,
    action: str,
    target: str,
    message: str,
    *,
    source: str | None,
    severity: str = "warning",
) -> Event | None:
    """Record what an unauthenticated client caused (a refused boot token, a refused discovery), at most
    one event per (action, client address) a minute; the rest are summed into one later event."""
    key = (action, source or "unknown")
    write, suppressed = _throttle.admit(key, target, actor, time.monotonic())
    if suppressed:
        record(
            session,
            actor,
            action,
            target,
            f"{suppressed} more like this from {key[1]} in the last minute "
            "(counted, not recorded one by one)",
            severity=severity,
            detail={"source": key[1], "count": suppressed},
        )
    if not write:
        return None
    return record(session, actor, action, target, message, severity=severity, detail={"source": key[1]})


def flush_throttled(session: Session) -> int:
    """Write the summaries of windows that closed with refusals counted (a periodic loop calls this)."""
    done = _throttle.closed(time.monotonic())
    for (action, source), count, target, actor in done:
        record(
            session,
            actor,
            action,
            target,
            f"{count} more like this from {source} in the last minute (counted, not recorded one by one)",
            severity="warning",
            detail={"source": source, "count": count},
        )
    return len(done)


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
