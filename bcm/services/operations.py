"""Operations: persisted long jobs with progress, per-node results and a log."""

from __future__ import annotations

import logging
from typing import Any

from sqlmodel import Session, col, select

from bcm.errors import NotFound
from bcm.models.base import utcnow
from bcm.models.operation import Operation, OpState

MAX_LOG_CHARS = 1_000_000
_log = logging.getLogger("bcm.operations")  # one INFO line per start, end and failed node


def create(session: Session, kind: str, targets: str, total: int, actor: str) -> Operation:
    op = Operation(kind=kind, targets=targets, progress_total=total, created_by=actor, results={})
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
