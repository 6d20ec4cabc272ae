"""Operations: persisted long jobs with progress, per-node results and a log."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import update
from sqlmodel import Session, col, select

from bcm.errors import Conflict, NotFound
from bcm.models.base import utcnow
from bcm.models.node import Node
from bcm.models.operation import Operation, OpState

MAX_LOG_CHARS = 1_000_000
_log = logging.getLogger("bcm.operations")  # one INFO line per start, end and failed node


def create(session: Session, kind: str, targets: str, total: int, actor: str) -> Operation:
    op = Operation(
        kind=kind,
        targets=targets,
        progress_total=total,
        created_by=actor,
        results={},
        runner=PROCESS_ID,
        heartbeat_at=utcnow(),
    )
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


def start(session: Session, op: Operation) -> None:
    op.state, op.started_at = OpState.RUNNING.value, utcnow()
    session.add(op)
    _log.info("operation %s %s started by %s on %s", op.id, op.kind, op.created_by, op.targets[:120])


def add_results(session: Session, op: Operation, results: dict[str, dict[str, Any]], log: str = "") -> None:
    """Record finished hosts (results replace the JSON value so every backend sees the change)."""
    op.results = {**(op.results or {}), **results}
    for name, result in results.items():
        if result.get("status") != "ok":
            why = str(result.get("error") or result.get("message") or "")[:200]
            _log.info("operation %s %s: %s %s: %s", op.id, op.kind, name, result.get("status"), why)
    op.progress_done = len(op.results)
    if log:
        op.log = (op.log + log)[-MAX_LOG_CHARS:]
    session.add(op)


def is_finished(op: Operation) -> bool:
    return OpState(op.state).finished


def finish(session: Session, op: Operation, error: str | None = None) -> None:
    """Close the operation: failed on error or all hosts failed, partial on some, else succeeded."""
    statuses = [r.get("status") for r in (op.results or {}).values()]
    if error or (statuses and all(s != "ok" for s in statuses)):
        state = OpState.FAILED
    elif any(s != "ok" for s in statuses):
        state = OpState.PARTIAL
    else:
        state = OpState.SUCCEEDED
    op.state, op.error, op.finished_at = state.value, error, utcnow()
    session.add(op)
    _log.info("operation %s %s %s%s", op.id, op.kind, state.value, f": {error[:300]}" if error else "")


# ---- operations that outlive their server, and cancelling one -------------------------------------

PROCESS_ID = f"{socket.gethostname()[:64]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
"""This server process; recorded on every operation it starts (``runner``)."""
_OPEN = (OpState.PENDING.value, OpState.RUNNING.value)


def lock_owner(op_id: int) -> str:
    """The per-node lock owner of an operation: releasing an operation's locks needs only its id."""
    return f"op-{op_id}"


def heartbeat(session: Session, runner: str = PROCESS_ID) -> list[int]:
    """Say this process is alive for its open operations; returns the ids of those still open."""
    session.execute(
        update(Operation)
        .where(col(Operation.runner) == runner, col(Operation.state).in_(_OPEN))
        .values(heartbeat_at=utcnow())
    )
    mine = select(Operation.id).where(Operation.runner == runner, col(Operation.state).in_(_OPEN))
    return [i for i in session.exec(mine) if i is not None]


def orphans(session: Session, *, silent_since: datetime | None, runner: str = PROCESS_ID) -> list[Operation]:
    """Open operations of other processes: all of them (``silent_since`` None), or those silent since."""
    stmt = select(Operation).where(col(Operation.state).in_(_OPEN))
    stmt = stmt.where((col(Operation.runner).is_(None)) | (col(Operation.runner) != runner))
    if silent_since is not None:
        stmt = stmt.where(
            (col(Operation.heartbeat_at).is_(None)) | (col(Operation.heartbeat_at) < silent_since)
        )
    return list(session.exec(stmt.order_by(col(Operation.id))))


def close(session: Session, op: Operation, state: OpState, why: str) -> None:
    """End an open operation as interrupted or cancelled: results kept, its node locks released."""
    op.state, op.error, op.finished_at = state.value, why, utcnow()
    op.log = (op.log + f"{state.value}: {why}\n")[-MAX_LOG_CHARS:]
    session.add(op)
    assert op.id is not None
    session.execute(
        update(Node)
        .where(col(Node.lock_owner) == lock_owner(op.id))
        .values(lock_owner=None, lock_expires=None, target_state=None)
        .execution_options(synchronize_session=False)
    )


def cancel(session: Session, op_id: int, actor: str) -> Operation:
    """Stop an open operation on request; 409 if it has already ended."""
    op = get(session, op_id)
    if is_finished(op):
        raise Conflict(f"operation {op_id} has already ended: it is {op.state}")
    close(session, op, OpState.CANCELLED, f"cancelled by {actor}")
    return op
