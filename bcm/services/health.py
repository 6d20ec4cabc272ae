"""GPU health use cases: ingest agent reports, decide drains and resumes, mark silent nodes stale.

One report is one transaction of few statements: read the node's context (category policy, inventoried
GPU count, stored health) and its GPUs' previous state, judge the report with
:func:`bcm.domain.health.evaluate`, then write the GPUs' latest state (upsert), the history rows, events
(only for what changed) and the node row. On PostgreSQL those writes are one statement (data-modifying
CTEs over ``unnest`` arrays, so one round trip and a prepared plan) committed without waiting for the WAL
flush: a report lost to a crash is replaced by the next one. History is pruned per node every ``history_per_gpu // 10`` reports, so its
cost is spread thin and each GPU keeps between ``history_per_gpu`` and 110 % of it.

A FAIL holds (the node's verdict stays FAIL) until the node has sent
``settings.health.resume_after_ok_intervals`` healthy reports in a row; healthy means OK or WARN,
since a WARN never drains. Entering FAIL asks for a drain, leaving it asks for a resume, but only of a
drain bcm made: a node an admin drained is left alone. The request only records the decision
(``NodeHealth.pending_action``); :mod:`bcm.workers.health` carries it out (node state, then the
workload manager) and retries it, so no slow external call sits inside an agent's report.

Services flush but never commit: the request or background job owns the transaction.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any

from sqlalchemy import bindparam, delete, func, insert, text, update
from sqlalchemy import select as sa_select
from sqlmodel import Session, col, select

from bcm.domain.health import (
    XID_RULES,
    Action,
    Finding,
    GpuVerdict,
    NodeVerdict,
    Thresholds,
    Verdict,
    evaluate,
)
from bcm.domain.health_policy import HealthPolicy
from bcm.domain.health_report import HealthReport
from bcm.domain.states import State
from bcm.errors import BcmError, Forbidden, InvalidInput, NotFound
from bcm.models.base import INT32_MAX, utcnow
from bcm.models.category import Category
from bcm.models.gpu import Gpu
from bcm.models.health import GpuHealth, HealthEvent, HealthSample, NodeHealth
from bcm.models.node import Node
from bcm.services import nodes as node_svc
from bcm.settings import HealthSettings

log = logging.getLogger("bcm.health")

ACTOR = "bcm:health"
DRAIN, RESUME = "drain", "resume"
MAX_ACTION_ATTEMPTS = 5
HEALTHY = (Verdict.OK, Verdict.WARN)
IN_SERVICE = (State.BOOTED.value, State.READY.value)
DRAINED = (State.DRAINING.value, State.DRAINED.value)


@dataclass(frozen=True)
class _PrevGpu:
    uuid: str
    verdict: str
    reasons: list[dict[str, Any]] | None
    xid_count: int


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
            col(Node.name), col(Node.provision_state), col(Node.inventoried_at), col(Category.health_policy),
            gpu_count, col(NodeHealth.node_id), col(NodeHealth.verdict), col(NodeHealth.consecutive_ok),
            col(NodeHealth.drained_by_bcm), col(NodeHealth.drain_reason), col(NodeHealth.pending_action),
            col(NodeHealth.action_attempts), col(NodeHealth.samples_since_prune),
        )
        .outerjoin(Category, col(Category.id) == col(Node.category_id))
        .outerjoin(NodeHealth, col(NodeHealth.node_id) == col(Node.id))
        .where(col(Node.id) == bindparam("node_id"))
    )  # fmt: skip


# Built once: statement construction is a real share of the per-report cost at 1,000 reports/s.
_CONTEXT = _context_query()
_PREVIOUS = sa_select(
    col(GpuHealth.index), col(GpuHealth.uuid), col(GpuHealth.verdict), col(GpuHealth.reasons),
    col(GpuHealth.xid_count),
).where(col(GpuHealth.node_id) == bindparam("node_id"))  # fmt: skip


@dataclass
class _NodeState:
    """The stored NodeHealth fields the decisions read and change."""

    node_id: int
    verdict: str = Verdict.UNKNOWN.value
    consecutive_ok: int = 0
    drained_by_bcm: bool = False
    drain_reason: str | None = None
    pending_action: str | None = None
    action_attempts: int = 0
    samples_since_prune: int = 0


def ingest(
    session: Session,
    node_id: int,
    report: HealthReport,
    settings: HealthSettings,
    now: datetime | None = None,
) -> IngestResult:
    """Store one validated report of ``node_id`` and record any drain/resume decision."""
    now = now or utcnow()
    conn = session.connection()
    dialect = conn.dialect.name
    if dialect == "postgresql":
        # A report lost to a crash is replaced by the next one (and a lost decision is made again
        # from the older verdict), so the commit need not wait for the WAL flush.
        conn.exec_driver_sql("SET LOCAL synchronous_commit TO OFF")
    ctx = conn.execute(_CONTEXT, {"node_id": node_id}).one_or_none()
    if ctx is None:
        raise NotFound(f"node {node_id} not found")
    name, state, inventoried_at, policy, inventoried_gpus, stored, *rest = ctx
    check_reporter(name, report)
    first = stored is None
    nh = _NodeState(node_id) if first else _NodeState(node_id, *rest)
    expected = int(inventoried_gpus) if inventoried_at is not None else None
    judged = evaluate(report.rules_input(), thresholds_for(policy), expected)
    previous = {
        int(index): _PrevGpu(uuid, verdict, reasons, xid_count)
        for index, uuid, verdict, reasons, xid_count in conn.execute(_PREVIOUS, {"node_id": node_id})
    }
    raw = judged.verdict
    ok_run = nh.consecutive_ok + 1 if raw in HEALTHY else 0
    was_fail = not first and nh.verdict == Verdict.FAIL.value
    holding = raw is not Verdict.FAIL and was_fail and ok_run < settings.resume_after_ok_intervals
    effective = Verdict.FAIL if holding else raw
    held = _held_finding(ok_run, settings.resume_after_ok_intervals) if holding else None

    samples = {int(g.index): g for g in report.gpus}
    gpu_rows, sample_rows, events, verdict_changes = [], [], [], []
    for gv in judged.gpus:
        prev = previous.get(gv.index)
        uuid = gv.uuid or (prev.uuid if prev else None) or f"{name}:gpu{gv.index}"
        verdict, reasons = gv.verdict, [r.to_dict() for r in gv.reasons]
        if (
            holding
            and prev is not None
            and prev.verdict == Verdict.FAIL.value
            and verdict is not Verdict.FAIL
        ):
            verdict = Verdict.FAIL
            reasons = [*(prev.reasons or [])[:20], held.to_dict()] if held else list(prev.reasons or [])
        xids = [int(r.code[4:]) for r in gv.reasons if r.code.startswith("xid.")]
        gpu_rows.append(_gpu_row(node_id, uuid, verdict, reasons, samples[gv.index], xids, prev, now))
        sample_rows.append(_sample_row(node_id, uuid, verdict, samples[gv.index], xids, now))
        events += [_event(node_id, now, f, gv.index, uuid) for f in gv.reasons if f.code.startswith("xid.")]
        old = prev.verdict if prev else None
        if old != verdict.value and (old is not None or verdict is not Verdict.OK):
            verdict_changes.append((gv.index, verdict.value))
            events.append(_gpu_change_event(node_id, now, gv, uuid, old, verdict))
    events += [_event(node_id, now, f) for f in judged.findings if f.code.startswith("xid.")]

    node_findings = [f.to_dict() for f in judged.findings] + ([held.to_dict()] if held else [])
    old_node = None if first else nh.verdict
    if old_node != effective.value and (old_node is not None or effective is not Verdict.OK):
        events.append(_node_change_event(node_id, now, old_node, effective, judged))

    action = _decide(nh, state, first, effective, raw, judged, name, events, now)

    gone = set(previous) - set(samples)
    if gone:  # a GPU no longer reported keeps no stale "latest" row
        conn.execute(
            delete(GpuHealth).where(col(GpuHealth.node_id) == node_id, col(GpuHealth.index).in_(gone))
        )
    for index, verdict_value in verdict_changes:
        conn.execute(
            update(Gpu)
            .where(col(Gpu.node_id) == node_id, col(Gpu.index) == index)
            .values(verdict=verdict_value)
        )

    nh.samples_since_prune += 1
    prune = nh.samples_since_prune >= prune_every(settings)
    if prune:
        nh.samples_since_prune = 0
    row = {
        **dataclasses.asdict(nh),
        "verdict": effective.value,
        "report_verdict": raw.value,
        "last_report_at": now,
        "collected_at": report.collected_at,
        "consecutive_ok": ok_run,
        "gpu_count": report.gpu_count,
        "agent_version": report.agent_version[:64],
        "driver_version": (report.driver_version or "")[:64] or None,
        "findings": node_findings,
        "updated_at": now,
    }
    _write_all(
        conn,
        [
            (GpuHealth, gpu_rows, True),
            (HealthSample, sample_rows, False),
            (HealthEvent, events, False),
            (NodeHealth, [row], True),
        ],
    )
    if prune:  # after this report's samples are in, so each GPU keeps history_per_gpu of them
        prune_history(session, node_id, [g["uuid"] for g in gpu_rows], settings)
    return IngestResult(node_id, name, effective.value, raw.value, action)


def _held_finding(ok_run: int, needed: int) -> Finding:
    return Finding(
        "health.held",
        Verdict.FAIL,
        f"FAIL holds until {needed} healthy reports in a row ({ok_run} so far)",
        Action.NONE,
    )


def _gpu_row(
    node_id: int,
    uuid: str,
    verdict: Verdict,
    reasons: list[dict[str, Any]],
    g: Any,
    xids: list[int],
    prev: _PrevGpu | None,
    now: datetime,
) -> dict[str, Any]:
    rows, pages = g.remapped_rows, g.retired_pages
    return {
        "node_id": node_id,
        "index": int(g.index),
        "uuid": uuid[:96],
        "name": g.name,
        "pci_bus_id": (g.pci_bus_id or "")[:32] or None,
        "verdict": verdict.value,
        "reasons": reasons,
        "temperature_c": g.temperature_c,
        "power_draw_w": g.power_draw_w,
        "utilization_gpu_pct": g.utilization_gpu_pct,
        "utilization_memory_pct": g.utilization_memory_pct,
        "memory_total_mib": g.memory_total_mib,
        "memory_used_mib": g.memory_used_mib,
        "ecc_sbe_volatile": g.ecc.volatile_corrected,
        "ecc_dbe_volatile": g.ecc.volatile_uncorrected,
        "ecc_sbe_aggregate": g.ecc.aggregate_corrected,
        "ecc_dbe_aggregate": g.ecc.aggregate_uncorrected,
        "pcie_replay": g.pcie.replay_counter,
        "remap_correctable": rows.correctable if rows else None,
        "remap_uncorrectable": rows.uncorrectable if rows else None,
        "remap_pending": rows.pending if rows else None,
        "remap_failure": rows.failure if rows else None,
        "retired_sbe": pages.single_bit if pages else None,
        "retired_dbe": pages.double_bit if pages else None,
        "retired_pending": pages.pending if pages else None,
        # dcgm-exporter's XID_ERRORS is the last Xid seen; keep it until another one replaces it
        "last_xid": xids[-1] if xids else None,
        "xid_count": min(INT32_MAX, (prev.xid_count if prev else 0) + len(xids)),
        "sampled_at": now,
    }


def _sample_row(
    node_id: int, uuid: str, verdict: Verdict, g: Any, xids: list[int], now: datetime
) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "uuid": uuid[:96],
        "gpu_index": int(g.index),
        "time": now,
        "verdict": verdict.value,
        "temperature_c": g.temperature_c,
        "power_draw_w": g.power_draw_w,
        "utilization_gpu_pct": g.utilization_gpu_pct,
        "memory_used_mib": g.memory_used_mib,
        "ecc_sbe_volatile": g.ecc.volatile_corrected,
        "ecc_dbe_volatile": g.ecc.volatile_uncorrected,
        "xid": xids[-1] if xids else None,
    }


_STATEMENTS: dict[tuple[Any, ...], Any] = {}
_PG_ARRAY_TYPES = {"INTEGER": "int4", "BIGINT": "int8", "BIGINTEGER": "int8", "FLOAT": "float8", "BOOLEAN": "bool", "JSON": "json"}


def _pg_array_type(column: Any) -> str:
    name = type(column.type).__name__.upper()
    if name == "UTCDATETIME":
        return "timestamptz"
    return _PG_ARRAY_TYPES.get(name, "text")


def _pg_insert_sql(model: Any, keys: tuple[str, ...], upsert: bool, prefix: str) -> str:
    """``INSERT … SELECT FROM unnest(<one array parameter per column>)``: short and prepared, any row count."""
    table: Any = model.__table__
    pk = [c.name for c in table.primary_key.columns]
    cols = ", ".join(f'"{k}"' for k in keys)
    arrays = ", ".join(f"%({prefix}{k})s::{_pg_array_type(table.c[k])}[]" for k in keys)
    sql = f"INSERT INTO {table.name} ({cols}) SELECT * FROM unnest({arrays})"  # noqa: S608 - our own names
    if upsert:
        sets = ", ".join(f'"{k}" = EXCLUDED."{k}"' for k in keys if k not in pk)
        sql += f" ON CONFLICT ({', '.join(pk)}) DO UPDATE SET {sets}"
    return sql


Write = tuple[Any, list[dict[str, Any]], bool]  # (model, rows of one shape, upsert)


def _write_all(conn: Any, writes: list[Write]) -> None:
    """All of a report's writes: one statement (data-modifying CTEs) on PostgreSQL, so one round trip;
    on SQLite (in-process, no round trips) one cached Core executemany per table."""
    writes = [w for w in writes if w[1]]
    if conn.dialect.name == "postgresql":
        key = ("pg", tuple((w[0].__name__, tuple(w[1][0]), w[2]) for w in writes))
        if key not in _STATEMENTS:
            parts = [
                _pg_insert_sql(m, tuple(rows[0]), up, f"w{i}_") for i, (m, rows, up) in enumerate(writes)
            ]
            ctes = ", ".join(f"w{i} AS ({sql} RETURNING 1)" for i, sql in enumerate(parts[:-1]))
            _STATEMENTS[key] = (f"WITH {ctes} " if ctes else "") + parts[-1]
        params: dict[str, Any] = {}
        for i, (model, rows, _up) in enumerate(writes):
            table: Any = model.__table__
            for k in rows[0]:
                as_json = _pg_array_type(table.c[k]) == "json"
                params[f"w{i}_{k}"] = [
                    json.dumps(r[k]) if as_json and r[k] is not None else r[k] for r in rows
                ]
        conn.exec_driver_sql(_STATEMENTS[key], params)
        return
    for model, rows, upsert in writes:
        conn.execute(_sqlite_statement(model, tuple(rows[0]), upsert), rows)


def _sqlite_statement(model: Any, keys: tuple[str, ...], upsert: bool) -> Any:
    table: Any = model.__table__
    key = ("sqlite", table.name, keys, upsert)
    if key not in _STATEMENTS:
        from sqlalchemy.dialects import sqlite

        stmt: Any = sqlite.insert(table)
        if upsert:
            pk = [c.name for c in table.primary_key.columns]
            stmt = stmt.on_conflict_do_update(
                index_elements=pk, set_={k: stmt.excluded[k] for k in keys if k not in pk}
            )
        _STATEMENTS[key] = stmt
    return _STATEMENTS[key]


def prune_every(settings: HealthSettings) -> int:
    return max(10, settings.history_per_gpu // 10)


def prune_history(session: Session, node_id: int, uuids: Iterable[str], settings: HealthSettings) -> None:
    """Keep the newest ``history_per_gpu`` samples of each of this node's GPUs and its newest
    ``events_per_node`` events (indexed DELETEs, all within the node's own rows)."""
    for uuid in uuids:
        session.execute(
            text(
                "DELETE FROM healthsample WHERE node_id = :node AND uuid = :u AND id < ("
                "SELECT id FROM healthsample WHERE node_id = :node AND uuid = :u"
                " ORDER BY id DESC LIMIT 1 OFFSET :n)"
            ),
            {"node": node_id, "u": uuid, "n": settings.history_per_gpu - 1},
        )
    session.execute(
        text(
            "DELETE FROM healthevent WHERE node_id = :node AND id < ("
            "SELECT id FROM healthevent WHERE node_id = :node ORDER BY id DESC LIMIT 1 OFFSET :n)"
        ),
        {"node": node_id, "n": settings.events_per_node - 1},
    )


def _event(
    node_id: int,
    now: datetime,
    f: Finding,
    gpu_index: int | None = None,
    uuid: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {
        "time": now,
        "node_id": node_id,
        "gpu_uuid": uuid,
        "gpu_index": gpu_index,
        "severity": f.severity.value,
        "code": (code or f.code)[:64],
        "message": f.message[:1024],
        "action": f.action.value,
    }


def _worst_finding(findings: Sequence[Finding]) -> Finding | None:
    rank = {Verdict.OK: 0, Verdict.UNKNOWN: 1, Verdict.WARN: 2, Verdict.FAIL: 3}
    return max(findings, key=lambda f: rank[f.severity], default=None)


def _gpu_change_event(
    node_id: int, now: datetime, gv: GpuVerdict, uuid: str, old: str | None, new: Verdict
) -> dict[str, Any]:
    top = _worst_finding([r for r in gv.reasons if r.severity is not Verdict.OK])
    why = "; ".join(r.message for r in gv.reasons if r.severity is not Verdict.OK)[:900]
    message = f"GPU {gv.index} {old or 'new'} -> {new.value}" + (f": {why}" if why else "")
    return {
        "time": now,
        "node_id": node_id,
        "gpu_uuid": uuid,
        "gpu_index": gv.index,
        "severity": new.value,
        "code": "gpu.verdict",
        "message": message[:1024],
        "action": top.action.value if top else None,
    }


def _node_change_event(
    node_id: int, now: datetime, old: str | None, new: Verdict, judged: NodeVerdict
) -> dict[str, Any]:
    top = _worst_finding(
        [*judged.findings, *(r for g in judged.gpus for r in g.reasons if r.severity is not Verdict.OK)]
    )
    message = f"node {old or 'new'} -> {new.value}" + (
        f": {top.message}" if top and new is not Verdict.OK else ""
    )
    return {
        "time": now,
        "node_id": node_id,
        "gpu_uuid": None,
        "gpu_index": None,
        "severity": new.value,
        "code": "node.verdict",
        "message": message[:1024],
        "action": top.action.value if top and new is not Verdict.OK else None,
    }


def drain_reason(judged: NodeVerdict) -> str:
    """Slurm's Reason for a bcm drain: ``bcm: GPU <index> <uuid> XID 79 GPU has fallen off the bus``."""
    for g in judged.gpus:
        for f in g.reasons:
            if f.severity is Verdict.FAIL:
                return _reason_text(f"GPU {g.index} {g.uuid or '?'} ", f)
    for f in judged.findings:
        if f.severity is Verdict.FAIL:
            return _reason_text("", f)
    return "bcm: GPU health FAIL"


def _reason_text(prefix: str, f: Finding) -> str:
    if f.code.startswith("xid.") and f.code[4:].isdigit():
        xid = int(f.code[4:])
        rule = XID_RULES.get(xid)
        what = f"XID {xid} {rule.meaning if rule else f.message}"
    else:
        what = f"{f.code} {f.message}"
    # Slurm quotes the reason; keep it one short line without quotes
    return ("bcm: " + prefix + what).replace('"', "'").replace("\n", " ")[:200]


def _decide(
    nh: _NodeState,
    state: str,
    first: bool,
    effective: Verdict,
    raw: Verdict,
    judged: NodeVerdict,
    name: str,
    events: list[dict[str, Any]],
    now: datetime,
) -> str | None:
    """Record a drain on entering FAIL and a resume on leaving it (bcm's own drains only)."""
    node_id = nh.node_id
    was_fail = not first and nh.verdict == Verdict.FAIL.value
    if effective is Verdict.FAIL and not was_fail:
        if state in DRAINED and not nh.drained_by_bcm:
            events.append(
                _action_event(
                    node_id,
                    now,
                    "drain.skipped",
                    Verdict.FAIL,
                    f"{name} is already {state} by an admin; bcm leaves that drain alone",
                )
            )
            return None
        nh.drained_by_bcm, nh.drain_reason = True, drain_reason(judged)
        nh.pending_action, nh.action_attempts = DRAIN, 0
        events.append(_action_event(node_id, now, "drain.requested", Verdict.FAIL, nh.drain_reason, DRAIN))
        return DRAIN
    if was_fail and effective is not Verdict.FAIL and nh.drained_by_bcm:
        if nh.pending_action == DRAIN:  # never carried out: nothing to undo
            nh.pending_action, nh.drained_by_bcm, nh.drain_reason = None, False, None
            return None
        nh.pending_action, nh.action_attempts = RESUME, 0
        events.append(
            _action_event(
                node_id,
                now,
                "resume.requested",
                Verdict.OK,
                f"{name} healthy for {nh.consecutive_ok + 1} reports in a row",
                RESUME,
            )
        )
        return RESUME
    return None  # fmt: skip


def _action_event(
    node_id: int, now: datetime, code: str, severity: Verdict, message: str, action: str | None = None
) -> dict[str, Any]:
    return {
        "time": now,
        "node_id": node_id,
        "gpu_uuid": None,
        "gpu_index": None,
        "severity": severity.value,
        "code": code,
        "message": message[:1024],
        "action": action,
    }


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
        sa_select(col(NodeHealth.node_id), col(Node.name), col(Node.provision_state), col(NodeHealth.pending_action),
               col(NodeHealth.drain_reason), col(NodeHealth.action_attempts))
        .join(Node, col(Node.id) == col(NodeHealth.node_id))
        .where(col(NodeHealth.pending_action).is_not(None))
        .order_by(col(NodeHealth.node_id))
        .limit(limit)
    )  # fmt: skip
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
            [_action_event(item.node_id, now, f"{item.action}.done", Verdict.OK, done, item.action)],
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
    session.execute(insert(HealthEvent), [_action_event(item.node_id, now, f"{item.action}.failed", Verdict.WARN, message, item.action)])  # fmt: skip


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
        events.append(_event(node_id, now, f))
    session.execute(insert(HealthEvent), events)
    session.flush()
    return [r[1] for r in rows]  # fmt: skip


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
    "note_admin_verb",
    "prune_history",
    "stale_cutoff",
    "sweep_stale",
    "thresholds_for",
]
