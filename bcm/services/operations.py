"""Operations: persisted long jobs with progress, per-node results, a log, and a lease.

An open operation is held by one server (``owner``) until ``lease_expires``; its node locks last as
long as the lease (they are renewed with it and lapse with it). The holder renews while its task
lives; an open operation whose lease has lapsed is taken up by the next server that looks
(:func:`reclaimable` + :func:`take`, ``FOR UPDATE SKIP LOCKED`` on PostgreSQL so two servers never
take the same one). A job's writes are fenced (:func:`fence`): once its operation has ended or
another server holds it, they raise :class:`LeaseLost` and nothing of that transaction is kept.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, or_, update
from sqlmodel import Session, col, select

from bcm.errors import Conflict, NotFound
from bcm.models.base import utcnow
from bcm.models.node import Node
from bcm.models.operation import Operation, OpState

MAX_LOG_CHARS = 1_000_000
_log = logging.getLogger("bcm.operations")  # one INFO line per start, end and failed node
_OPEN = (OpState.PENDING.value, OpState.RUNNING.value)


@dataclass(frozen=True)
class Holder:
    """A job's claim on its operation: the server and which take (``claims``) it runs under."""

    server: str
    claims: int


HOLDER: ContextVar[Holder | None] = ContextVar("bcm_operation_holder", default=None)
"""Set by the runner in a job's task: the job's writes to its operation are fenced by it."""


class LeaseLost(Conflict):
    """A write to an operation that has ended (cancelled …) or that another server holds now."""


def create(
    session: Session, kind: str, targets: str, total: int, actor: str, spec: dict[str, Any] | None = None
) -> Operation:
    op = Operation(kind=kind, targets=targets, progress_total=total, created_by=actor, results={}, spec=spec)
    session.add(op)
    session.flush()
    return op


def get(session: Session, op_id: int) -> Operation:
    op = session.get(Operation, op_id)
    if op is None:
        raise NotFound(f"operation {op_id} not found")
    return op


def query(
    session: Session, *, kind: str | None = None, state: str | None = None, limit: int = 50, offset: int = 0
) -> list[Operation]:
    stmt = select(Operation)
    if kind:
        stmt = stmt.where(Operation.kind == kind)
    if state:
        stmt = stmt.where(Operation.state == state)
    return list(session.exec(stmt.order_by(col(Operation.id).desc()).offset(offset).limit(limit)))


def lock_owner(op_id: int) -> str:
    """The per-node lock owner of an operation: releasing an operation's locks needs only its id."""
    return f"op-{op_id}"


def is_finished(op: Operation) -> bool:
    return OpState(op.state).finished


# ---- fenced writes (a job's) ----------------------------------------------------------------------


def fence(session: Session, op: Operation) -> None:
    """Refuse (LeaseLost) unless ``op`` is open and held by the task's server; then read it afresh.

    The check is a compare-and-set on the row: it takes the row lock (PostgreSQL) or the write turn
    (SQLite) until commit, so a cancel or a reclaim lands wholly before or wholly after this write.
    """
    session.flush()
    assert op.id is not None
    holder = HOLDER.get()
    stmt = update(Operation).where(col(Operation.id) == op.id, col(Operation.state).in_(_OPEN))
    if holder is not None:
        stmt = stmt.where(col(Operation.owner) == holder.server, col(Operation.claims) == holder.claims)
    if session.execute(stmt.values(claims=Operation.claims)).rowcount != 1:  # type: ignore[attr-defined]
        raise LeaseLost(f"operation {op.id} has ended or is held by another server")
    session.refresh(op)


def start(session: Session, op: Operation) -> None:
    fence(session, op)
    op.state, op.started_at = OpState.RUNNING.value, op.started_at or utcnow()
    session.add(op)
    _log.info("operation %s %s started by %s on %s", op.id, op.kind, op.created_by, op.targets[:120])


def add_results(session: Session, op: Operation, results: dict[str, dict[str, Any]], log: str = "") -> None:
    """Record finished hosts (results replace the JSON value so every backend sees the change)."""
    fence(session, op)
    op.results = {**(op.results or {}), **results}
    for name, result in results.items():
        if result.get("status") != "ok":
            why = str(result.get("error") or result.get("message") or "")[:200]
            _log.info("operation %s %s: %s %s: %s", op.id, op.kind, name, result.get("status"), why)
    op.progress_done = len(op.results)
    if log:
        op.log = (op.log + log)[-MAX_LOG_CHARS:]
    session.add(op)


def append_log(session: Session, op: Operation, text: str, progress_done: int | None = None) -> None:
    fence(session, op)
    if text:
        op.log = (op.log + text)[-MAX_LOG_CHARS:]
    if progress_done is not None:
        op.progress_done = progress_done
    session.add(op)


def finish(session: Session, op: Operation, error: str | None = None) -> None:
    """Close the operation: failed on error or all hosts failed, partial on some, else succeeded.

    Its lease ends and its node locks are released in the same transaction.
    """
    fence(session, op)
    statuses = [r.get("status") for r in (op.results or {}).values()]
    if error or (statuses and all(s != "ok" for s in statuses)):
        state = OpState.FAILED
    elif any(s != "ok" for s in statuses):
        state = OpState.PARTIAL
    else:
        state = OpState.SUCCEEDED
    op.state, op.error, op.finished_at = state.value, error, utcnow()
    if error:
        op.log = (op.log + f"{state.value}: {error}\n")[-MAX_LOG_CHARS:]
    _end_lease(session, op)
    _log.info("operation %s %s %s%s", op.id, op.kind, state.value, f": {error[:300]}" if error else "")


def _end_lease(session: Session, op: Operation) -> None:
    op.owner, op.lease_expires = None, None
    session.add(op)
    assert op.id is not None
    session.execute(
        update(Node)
        .where(col(Node.lock_owner) == lock_owner(op.id))
        .values(lock_owner=None, lock_expires=None, target_state=None)
        .execution_options(synchronize_session=False)
    )


# ---- leases (the runner's) ------------------------------------------------------------------------


def take(session: Session, op: Operation, owner: str, until: datetime, now: datetime) -> bool:
    """Hold ``op`` (new, or open with a lapsed lease) for ``owner`` until ``until``; False if it is not
    free (another server took it first, or it has ended)."""
    assert op.id is not None
    session.flush()
    free = or_(
        col(Operation.owner).is_(None),
        col(Operation.lease_expires).is_(None),
        col(Operation.lease_expires) < now,
    )
    stmt = (
        update(Operation)
        .where(col(Operation.id) == op.id, col(Operation.state).in_(_OPEN), free)
        .values(owner=owner, lease_expires=until, claims=Operation.claims + 1)
    )
    if session.execute(stmt).rowcount != 1:  # type: ignore[attr-defined]
        return False
    session.refresh(op)
    return True


def renew(session: Session, owner: str, op_ids: list[int], until: datetime, now: datetime) -> set[int]:
    """Extend the leases (and node locks) of ``owner``'s operations that are still open and whose lease
    has not lapsed; returns those renewed. The others are no longer its own to run."""
    if not op_ids:
        return set()
    mine = (
        col(Operation.id).in_(op_ids),
        col(Operation.owner) == owner,
        col(Operation.state).in_(_OPEN),
        col(Operation.lease_expires) >= now,
    )
    held = [i for i in session.exec(select(Operation.id).where(*mine).with_for_update()) if i is not None]
    if held:
        session.execute(update(Operation).where(col(Operation.id).in_(held)).values(lease_expires=until))
        session.execute(
            update(Node)
            .where(col(Node.lock_owner).in_([lock_owner(i) for i in held]))
            .values(lock_expires=until)
            .execution_options(synchronize_session=False)
        )
    return set(held)


def reclaimable(session: Session, now: datetime, limit: int = 50) -> list[Operation]:
    """Open operations whose lease has lapsed (or that no server holds), oldest first; on PostgreSQL
    locked until commit and skipping those another server is taking right now."""
    stmt = (
        select(Operation)
        .where(
            col(Operation.state).in_(_OPEN),
            or_(
                col(Operation.owner).is_(None),
                col(Operation.lease_expires).is_(None),
                col(Operation.lease_expires) < now,
            ),
        )
        .order_by(col(Operation.id))
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    return list(session.exec(stmt))


def open_held(session: Session, owner: str | None = None) -> list[Operation]:
    """Open operations (of ``owner``, or every one)."""
    stmt = select(Operation).where(col(Operation.state).in_(_OPEN))
    if owner is not None:
        stmt = stmt.where(col(Operation.owner) == owner)
    return list(session.exec(stmt.order_by(col(Operation.id))))


def release(session: Session, op: Operation, owner: str, now: datetime) -> bool:
    """Hand an operation back (its server stops): the lease and its node locks lapse now, so the next
    server to look takes it up at once. False if ``owner`` no longer held it."""
    assert op.id is not None
    stmt = (
        update(Operation)
        .where(col(Operation.id) == op.id, col(Operation.owner) == owner, col(Operation.state).in_(_OPEN))
        .values(owner=None, lease_expires=now)
    )
    if session.execute(stmt).rowcount != 1:  # type: ignore[attr-defined]
        return False
    session.execute(
        update(Node)
        .where(col(Node.lock_owner) == lock_owner(op.id))
        .values(lock_expires=now)
        .execution_options(synchronize_session=False)
    )
    return True


def relock(session: Session, op: Operation, names: list[str], until: datetime, now: datetime) -> list[str]:
    """On a reclaim: hold again the nodes' locks that lapsed with the lease; returns the nodes it holds
    (a node another operation locked meanwhile is not among them)."""
    assert op.id is not None
    if not names:
        return []
    owner = lock_owner(op.id)
    free = or_(col(Node.lock_owner).is_(None), col(Node.lock_owner) == owner, col(Node.lock_expires) < now)
    session.execute(
        update(Node)
        .where(col(Node.name).in_(names), free)
        .values(lock_owner=owner, lock_expires=until)
        .execution_options(synchronize_session=False)
    )
    held = set(
        session.exec(select(Node.name).where(col(Node.name).in_(names), col(Node.lock_owner) == owner))
    )
    return [n for n in names if n in held]


# ---- ending an operation from outside its task ----------------------------------------------------


def close(session: Session, op: Operation, state: OpState, why: str) -> None:
    """End an open operation (cancelled, interrupted): results kept, lease ended, node locks released."""
    op.state, op.error, op.finished_at = state.value, why, utcnow()
    op.log = (op.log + f"{state.value}: {why}\n")[-MAX_LOG_CHARS:]
    _end_lease(session, op)
    _log.info("operation %s %s %s: %s", op.id, op.kind, state.value, why[:300])


def cancel(session: Session, op_id: int, actor: str) -> Operation:
    """Stop an open operation on request, wherever it runs; 409 if it has already ended."""
    stmt = (
        update(Operation)
        .where(col(Operation.id) == op_id, col(Operation.state).in_(_OPEN))
        .values(state=OpState.CANCELLED.value)
    )
    if session.execute(stmt).rowcount != 1:  # type: ignore[attr-defined]
        op = get(session, op_id)
        raise Conflict(f"operation {op_id} has already ended: it is {op.state}")
    op = get(session, op_id)
    session.refresh(op)
    close(session, op, OpState.CANCELLED, f"cancelled by {actor}")
    return op


def count_by_state(session: Session) -> dict[str, int]:
    """How many operations the database holds in each state (every state named, 0 where none is)."""
    counts = {state.value: 0 for state in OpState}
    rows = session.exec(select(Operation.state, func.count()).group_by(col(Operation.state))).all()
    for state, n in rows:
        counts[state] = int(n)
    return counts
