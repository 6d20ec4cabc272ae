"""GPU health use cases: ingest agent reports, carry out drains and resumes, mark silent nodes stale.

Ingest takes many reports in one transaction of few statements (:func:`ingest_many`; the write-behind
queue in :mod:`bcm.workers.ingest` gathers them): read every node's context (category policy,
inventoried GPU count, stored health, its GPUs' previous state) in two queries, judge each report with
:func:`bcm.domain.health_ingest.judge` (pure: verdicts, the FAIL hold, the drain/resume decision, the
rows), then write the GPUs' latest state (upsert), the history (one row per report), the events and the
node rows with :func:`bcm.db_bulk.write_rows` (one statement on PostgreSQL). History is pruned per node
every ``history_per_gpu // 10`` reports, so its cost is spread thin and each node keeps between
``history_per_gpu`` and 110 % of it.

A report only records a decision (``NodeHealth.pending_action``); :mod:`bcm.workers.health` carries it
out (node state, then the workload manager) and retries it, so no slow external call sits inside an
agent's report.

Services flush but never commit: the request or background job owns the transaction.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any

from sqlalchemy import bindparam, case, delete, func, insert, text, update
from sqlalchemy import select as sa_select
from sqlmodel import Session, col, select

from bcm.db_bulk import write_rows
from bcm.domain.health import Action, Finding, Thresholds, Verdict
from bcm.domain.health_ingest import (
    DRAIN,
    DRAINED,
    RESUME,
    Context,
    NodeState,
    Outcome,
    PrevGpu,
    drain_reason,
    event_row,
    finding_event,
    judge,
)
from bcm.domain.health_policy import HealthPolicy
from bcm.domain.health_report import HealthReport
from bcm.domain.states import State
from bcm.errors import BcmError, Forbidden, InvalidInput, NotFound
from bcm.models.base import utcnow
from bcm.models.category import Category
from bcm.models.gpu import Gpu
from bcm.models.health import GpuHealth, HealthEvent, HealthRecord, NodeHealth
from bcm.models.node import Node
from bcm.services import nodes as node_svc
from bcm.settings import HealthSettings

log = logging.getLogger("bcm.health")

ACTOR = "bcm:health"
MAX_ACTION_ATTEMPTS = 5
IN_SERVICE = (State.BOOTED.value, State.READY.value)


@dataclass(frozen=True)
class IngestResult:
    node_id: int
    node: str
    verdict: str
    report_verdict: str
    action: str | None  # drain | resume when a decision was recorded


# --- ingest -----------------------------------------------------------------------------------------


def check_reporter(node_name: str, report: HealthReport) -> None:
    """A node token reports for its own node only: the report's hostname (short form) must match."""
    short = report.hostname.split(".", 1)[0]
    if short != node_name:
        raise Forbidden(
            f"this token belongs to node {node_name!r}, but the report is from host {report.hostname!r}"
        )


@lru_cache(maxsize=256)
def _thresholds(policy_json: str | None) -> Thresholds:
    try:
        policy = HealthPolicy.model_validate_json(policy_json) if policy_json else None
        return Thresholds().merged(policy.stored() if policy else None)
    except (InvalidInput, ValueError):
        # written before policies were typed: judge with the defaults rather than refuse every report
        log.warning("category health policy cannot be applied; using default thresholds")
        return Thresholds()


def thresholds_for(policy: Mapping[str, Any] | None) -> Thresholds:
    """A category's thresholds (cached by policy content: categories are few, reports are many)."""
    return _thresholds(json.dumps(policy, sort_keys=True) if policy else None)


def _context_query() -> Any:
    gpu_count = select(func.count(col(Gpu.id))).where(col(Gpu.node_id) == col(Node.id)).scalar_subquery()
    return (
        sa_select(
            col(Node.id),
            col(Node.name),
            col(Node.provision_state),
            col(Node.inventoried_at),
            col(Category.health_policy),
            gpu_count,
            col(NodeHealth.node_id),
            col(NodeHealth.verdict),
            col(NodeHealth.consecutive_ok),
            col(NodeHealth.drained_by_bcm),
            col(NodeHealth.drain_reason),
            col(NodeHealth.pending_action),
            col(NodeHealth.action_attempts),
            col(NodeHealth.samples_since_prune),
        )
        .outerjoin(Category, col(Category.id) == col(Node.category_id))
        .outerjoin(NodeHealth, col(NodeHealth.node_id) == col(Node.id))
        .where(col(Node.id).in_(bindparam("ids", expanding=True)))
    )


# Built once: statement construction is a real share of the per-report cost at 1,000 reports/s.
_CONTEXT = _context_query()
# A GPU's stored reasons are read only to be carried on while its FAIL holds: only a failed GPU's are
# fetched (decoding every GPU's JSON was a tenth of a writer's time per report).
_PREVIOUS = sa_select(
    col(GpuHealth.node_id),
    col(GpuHealth.index),
    col(GpuHealth.uuid),
    col(GpuHealth.verdict),
    case((col(GpuHealth.verdict) == Verdict.FAIL.value, col(GpuHealth.reasons))),
    col(GpuHealth.xid_count),
).where(col(GpuHealth.node_id).in_(bindparam("ids", expanding=True)))


def _contexts(conn: Any, ids: list[int]) -> dict[int, Context]:
    """What bcm knows of each node in ``ids`` (two queries for all of them)."""
    contexts: dict[int, Context] = {}
    for node_id, name, state, inventoried_at, policy, gpus, stored, *rest in conn.execute(
        _CONTEXT, {"ids": ids}
    ):
        contexts[node_id] = Context(
            node_id,
            name,
            state,
            thresholds_for(policy),
            int(gpus) if inventoried_at is not None else None,
            None if stored is None else NodeState(node_id, *rest),
        )
    for node_id, index, uuid, verdict, reasons, xid_count in conn.execute(_PREVIOUS, {"ids": ids}):
        if node_id in contexts:
            contexts[node_id].previous[int(index)] = PrevGpu(uuid, verdict, reasons, xid_count)
    return contexts


def ingest(
    session: Session,
    node_id: int,
    report: HealthReport,
    settings: HealthSettings,
    now: datetime | None = None,
) -> IngestResult:
    """Store one validated report of ``node_id`` and record any drain/resume decision."""
    result = ingest_many(session, [(node_id, report)], settings, now)[0]
    if isinstance(result, BcmError):
        raise result
    return result


def ingest_many(
    session: Session,
    items: Sequence[tuple[int, HealthReport]],
    settings: HealthSettings,
    now: datetime | None = None,
) -> list[IngestResult | BcmError]:
    """Judge and store many validated reports (each of the node its token belongs to) in this transaction.

    One result per item, in order: what was stored, or the error of that item alone (its node is gone,
    or the report names another host) — the other items are stored all the same. A node's reports are
    judged in the order given, each meeting the state the one before left.
    """
    now = now or utcnow()
    conn = session.connection()
    contexts = _contexts(conn, sorted({node_id for node_id, _ in items}))
    outcomes: list[Outcome] = []
    results: list[IngestResult | BcmError] = []
    for node_id, report in items:
        ctx = contexts.get(node_id)
        if ctx is None:
            results.append(NotFound(f"node {node_id} not found"))
            continue
        try:
            check_reporter(ctx.name, report)
        except Forbidden as exc:
            results.append(exc)
            continue
        out = judge(
            ctx,
            report,
            resume_after=settings.resume_after_ok_intervals,
            prune_every=prune_every(settings),
            now=now,
        )
        contexts[node_id] = out.advance(ctx)
        outcomes.append(out)
        results.append(IngestResult(node_id, out.name, out.verdict, out.report_verdict, out.action))
    _store(session, outcomes, settings)
    return results


def _store(session: Session, outcomes: list[Outcome], settings: HealthSettings) -> None:
    """Write the outcomes: a node's latest rows are those of its last report; every history row and event."""
    if not outcomes:
        return
    conn = session.connection()
    last: dict[int, Outcome] = {}
    gone: dict[int, set[int]] = {}
    changes: dict[tuple[int, int], str] = {}
    for out in outcomes:
        last[out.node_id] = out
        gone.setdefault(out.node_id, set()).update(out.gone)
        changes.update({(out.node_id, index): verdict for index, verdict in out.verdict_changes})
    for node_id, indexes in sorted(gone.items()):
        indexes -= {g["index"] for g in last[node_id].gpu_rows}
        if indexes:  # a GPU no longer reported keeps no stale "latest" row
            conn.execute(
                delete(GpuHealth).where(col(GpuHealth.node_id) == node_id, col(GpuHealth.index).in_(indexes))
            )
    for (node_id, index), verdict in sorted(changes.items()):
        conn.execute(
            update(Gpu).where(col(Gpu.node_id) == node_id, col(Gpu.index) == index).values(verdict=verdict)
        )
    ordered = [last[node_id] for node_id in sorted(last)]  # one order for every writer: no deadlocks
    write_rows(
        conn,
        [
            (GpuHealth, [g for out in ordered for g in sorted(out.gpu_rows, key=lambda g: g["index"])], True),
            (HealthRecord, [out.record_row for out in outcomes], False),
            (HealthEvent, [e for out in outcomes for e in out.events], False),
            (NodeHealth, [out.node_row for out in ordered], True),
        ],
    )
    for node_id in sorted({out.node_id for out in outcomes if out.prune}):
        # after these records are in, so the node keeps history_per_gpu of them
        prune_history(session, node_id, settings)


def prune_every(settings: HealthSettings) -> int:
    return max(10, settings.history_per_gpu // 10)


def prune_history(session: Session, node_id: int, settings: HealthSettings) -> None:
    """Keep this node's newest ``history_per_gpu`` reports' readings and its newest ``events_per_node``
    events (indexed DELETEs, all within the node's own rows)."""
    session.execute(
        text(
            "DELETE FROM healthrecord WHERE node_id = :node AND id < ("
            "SELECT id FROM healthrecord WHERE node_id = :node ORDER BY id DESC LIMIT 1 OFFSET :n)"
        ),
        {"node": node_id, "n": settings.history_per_gpu - 1},
    )
    session.execute(
        text(
            "DELETE FROM healthevent WHERE node_id = :node AND id < ("
            "SELECT id FROM healthevent WHERE node_id = :node ORDER BY id DESC LIMIT 1 OFFSET :n)"
        ),
        {"node": node_id, "n": settings.events_per_node - 1},
    )


def note_admin_verb(session: Session, node_ids: Sequence[int], verb: str) -> None:
    """An admin's own drain or resume takes over: bcm will not resume (or re-drain) that node."""
    if verb in (DRAIN, RESUME) and node_ids:
        session.execute(
            update(NodeHealth)
            .where(col(NodeHealth.node_id).in_(node_ids))
            .values(drained_by_bcm=False, pending_action=None, drain_reason=None)
        )


# --- carrying out decisions (called by bcm.workers.health) ----------------------------------------------


@dataclass(frozen=True)
class PendingAction:
    node_id: int
    node: str
    action: str
    reason: str | None
    attempts: int
    state: str = ""  # bcm's node state after the move (or as it was, when none applied)
    moved: bool = False  # bcm's node state was moved


def claim_pending(
    session: Session, node_ids: Sequence[int] | None = None, limit: int = 100
) -> list[PendingAction]:
    """Take pending drains/resumes (one claimer wins per row) and move bcm's node state for each.

    The workload-manager half is the caller's; it reports back with :func:`finish_pending`.
    """
    stmt = (
        sa_select(
            col(NodeHealth.node_id),
            col(Node.name),
            col(Node.provision_state),
            col(NodeHealth.pending_action),
            col(NodeHealth.drain_reason),
            col(NodeHealth.action_attempts),
        )
        .join(Node, col(Node.id) == col(NodeHealth.node_id))
        .where(col(NodeHealth.pending_action).is_not(None))
        .order_by(col(NodeHealth.node_id))
        .limit(limit)
    )
    if node_ids is not None:
        stmt = stmt.where(col(NodeHealth.node_id).in_(node_ids))
    claimed: list[PendingAction] = []
    for node_id, name, state, action, reason, attempts in session.execute(stmt).all():
        won = session.execute(
            update(NodeHealth)
            .where(col(NodeHealth.node_id) == node_id, col(NodeHealth.pending_action) == action)
            .values(pending_action=None)
        )
        if won.rowcount != 1:  # type: ignore[attr-defined]
            continue  # another server process took it
        moved = None
        try:
            if action == DRAIN and state in IN_SERVICE:
                moved = node_svc.apply_verb(session, [name], DRAIN, ACTOR, reason)[0].provision_state
            elif action == RESUME and state in DRAINED:
                moved = node_svc.apply_verb(session, [name], RESUME, ACTOR, "GPU health recovered")[
                    0
                ].provision_state
        except BcmError as exc:  # e.g. an operation holds the node's lock: try again later
            finish_pending(session, PendingAction(node_id, name, action, reason, attempts), error=exc.message)
            continue
        claimed.append(
            PendingAction(node_id, name, action, reason, attempts, moved or state, moved is not None)
        )
    session.flush()
    return claimed


def finish_pending(
    session: Session, item: PendingAction, *, outcome: str | None = None, error: str | None = None
) -> None:
    """Record how the workload-manager half went; a failure is retried up to MAX_ACTION_ATTEMPTS times."""
    now = utcnow()
    if error is None:
        if outcome:
            done = f"{item.action} of {item.node}: {outcome}"
        elif item.moved:
            done = f"{item.action} of {item.node}: bcm node state now {item.state} (in no workload manager)"
        else:
            done = f"{item.action} of {item.node}: nothing to do (node is {item.state or 'not in service'}, in no workload manager)"
        session.execute(
            insert(HealthEvent),
            [event_row(item.node_id, now, f"{item.action}.done", Verdict.OK, done, item.action)],
        )
        if item.action == RESUME:
            session.execute(
                update(NodeHealth)
                .where(col(NodeHealth.node_id) == item.node_id)
                .values(drained_by_bcm=False, drain_reason=None, action_attempts=0)
            )
        return
    attempts = item.attempts + 1
    retry = attempts < MAX_ACTION_ATTEMPTS
    session.execute(
        update(NodeHealth)
        .where(col(NodeHealth.node_id) == item.node_id, col(NodeHealth.pending_action).is_(None))
        .values(pending_action=item.action if retry else None, action_attempts=attempts)
    )
    message = f"{item.action} of {item.node} failed (attempt {attempts}): {error}" + (
        "" if retry else "; giving up"
    )
    session.execute(
        insert(HealthEvent),
        [event_row(item.node_id, now, f"{item.action}.failed", Verdict.WARN, message, item.action)],
    )


# --- staleness ----------------------------------------------------------------------------------------


def sweep_stale(
    session: Session, settings: HealthSettings, now: datetime | None = None, limit: int = 5000
) -> list[str]:
    """Mark nodes silent for ``stale_intervals`` intervals UNKNOWN (a FAIL stays FAIL); returns their names."""
    now = now or utcnow()
    cutoff = now - timedelta(seconds=settings.interval_s * settings.stale_intervals)
    rows = session.exec(
        select(col(NodeHealth.node_id), col(Node.name), col(NodeHealth.last_report_at))
        .join(Node, col(Node.id) == col(NodeHealth.node_id))
        .where(col(NodeHealth.last_report_at) < cutoff, col(NodeHealth.verdict).in_(["OK", "WARN"]))
        .limit(limit)
    ).all()
    if not rows:
        return []
    ids = [r[0] for r in rows]
    for i in range(0, len(ids), 500):
        session.execute(
            update(NodeHealth)
            .where(col(NodeHealth.node_id).in_(ids[i : i + 500]), col(NodeHealth.verdict).in_(["OK", "WARN"]))
            .values(verdict=Verdict.UNKNOWN.value, consecutive_ok=0, updated_at=now)
        )
    events = []
    for node_id, _name, last in rows:
        age = (now - last).total_seconds() if last else 0.0
        f = Finding(
            "report.stale",
            Verdict.UNKNOWN,
            f"no health report for {age:.0f} s (>= {settings.stale_intervals} intervals of {settings.interval_s:g} s)",
            Action.CHECK_AGENT,
        )
        events.append(finding_event(node_id, now, f))
    session.execute(insert(HealthEvent), events)
    session.flush()
    return [r[1] for r in rows]


def stale_cutoff(settings: HealthSettings, now: datetime) -> datetime:
    return now - timedelta(seconds=settings.interval_s * settings.stale_intervals)


def node_id_of(session: Session, name: str) -> int:
    node_id = session.execute(select(col(Node.id)).where(col(Node.name) == name)).scalar_one_or_none()
    if node_id is None:
        raise NotFound(f"node {name!r} not found")
    return int(node_id)


__all__ = [
    "ACTOR",
    "IngestResult",
    "PendingAction",
    "check_reporter",
    "claim_pending",
    "drain_reason",
    "finish_pending",
    "ingest",
    "ingest_many",
    "note_admin_verb",
    "prune_history",
    "stale_cutoff",
    "sweep_stale",
    "thresholds_for",
]
