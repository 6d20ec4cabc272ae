"""Audit retention: a supervised loop writes the summaries of throttled unauthenticated refusals and
prunes the event log by age (``audit.retention_days``) and by count (``audit.max_events``).

Over the count, the oldest events go first, but only noise: what unauthenticated clients caused, what
bcm itself recorded, node and viewer tokens. An action of a person with a role (``admin:``, ``operator:``,
``user:``) inside the retention is never deleted for the count: the log may then stay above the cap
until those actions age out (a warning says so).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

import anyio
from sqlalchemy import ColumnElement, delete, func, not_, or_, select
from sqlalchemy.engine import Engine
from sqlmodel import col

from bcm.db import session_scope
from bcm.models.base import utcnow
from bcm.models.event import Event
from bcm.services import events
from bcm.settings import AuditSettings, Settings
from bcm.workers.supervise import supervise

log = logging.getLogger("bcm.audit")

PEOPLE = ("admin:", "operator:", "user:")  # actors whose actions are kept for the whole retention
BATCH = 5000  # rows per DELETE, each in its own transaction: no writer waits long for SQLite's write turn
MAX_BACKOFF_S = 3600.0


@dataclass
class Pruned:
    aged: int = 0  # older than the retention
    over_count: int = 0  # noise beyond max_events
    summaries: int = 0  # throttled refusals written as one event each


def _people() -> ColumnElement[bool]:
    return or_(*(col(Event.actor).startswith(p) for p in PEOPLE))


def _delete_ids(engine: Engine, where: ColumnElement[bool], limit: int) -> int:
    """Delete the oldest ``limit`` events matching ``where``, a batch a transaction; returns how many went."""
    done = 0
    while done < limit:
        oldest = select(col(Event.id)).where(where).order_by(col(Event.id)).limit(min(BATCH, limit - done))
        with session_scope(engine) as session:
            ids = list(session.execute(oldest).scalars())
            if ids:
                session.execute(delete(Event).where(col(Event.id).in_(ids)))
        if not ids:
            break
        done += len(ids)
    return done


def prune(engine: Engine, audit: AuditSettings, now: datetime | None = None) -> Pruned:
    """One pass of the retention rules."""
    now = now or utcnow()
    result = Pruned()
    cutoff = now - timedelta(days=audit.retention_days)
    result.aged = _delete_ids(engine, col(Event.time) < cutoff, 1 << 62)
    with session_scope(engine) as session:
        total = session.execute(select(func.count()).select_from(Event)).scalar_one()
    excess = total - audit.max_events
    if excess > 0:
        result.over_count = _delete_ids(engine, not_(_people()), excess)
        if result.over_count < excess:
            log.warning(
                "audit log holds %d events, over audit.max_events=%d: the rest are people's actions inside "
                "the retention of %g days, kept",
                total - result.over_count,
                audit.max_events,
                audit.retention_days,
            )
    return result


def run_once(engine: Engine, settings: Settings) -> Pruned:
    """Write the closed throttle windows' summaries, then prune."""
    with session_scope(engine) as session:
        summaries = events.flush_throttled(session)
    result = prune(engine, settings.audit)
    result.summaries = summaries
    if result.aged or result.over_count:
        log.info("audit log pruned: %d past retention, %d over the count", result.aged, result.over_count)
    return result


async def loop(
    engine: Engine, settings: Settings, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
) -> None:
    """Run :func:`run_once` every ``audit.prune_interval_s``, supervised: a failure is logged once per
    streak and retried after a doubling delay (at most an hour). Cancel to stop: a pass under way finishes
    first (it is in a thread)."""

    async def one_pass() -> None:
        await anyio.to_thread.run_sync(run_once, engine, settings)

    interval = settings.audit.prune_interval_s
    await supervise("audit pruning", one_pass, interval, max_backoff_s=MAX_BACKOFF_S, logger=log, sleep=sleep)
