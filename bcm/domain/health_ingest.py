"""The pure half of ingesting a health report: what to store and what to decide, with no database.

:func:`judge` takes what bcm knows of a node (its stored health, its GPUs' previous state, its lifecycle
state, the GPU count inventory found) and one validated report, and returns an :class:`Outcome`: the GPUs'
latest rows, the history row, the events (only for what changed), the node's health row and the
drain/resume decision. :mod:`bcm.services.health` reads the context and writes the outcome, many
reports per transaction.

Holding: a FAIL holds (the node's verdict stays FAIL) until the node has sent ``resume_after`` healthy
reports in a row; healthy means OK or WARN, since a WARN never drains. Deciding: entering FAIL asks for a
drain, leaving it asks for a resume, but only of a drain bcm made: a node an admin drained is left alone
(an event says so).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from bcm.domain.bounds import INT32_MAX
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
from bcm.domain.health_report import GpuSampleIn, HealthReport
from bcm.domain.states import State

DRAIN, RESUME = "drain", "resume"
_NONE: dict[
    str, Any
] = {}  # a part of a GPU sample the agent left out or NVML did not offer: every reading None
HEALTHY = (Verdict.OK, Verdict.WARN)
DRAINED = (State.DRAINING.value, State.DRAINED.value)


@dataclass(frozen=True)
class PrevGpu:
    """What is stored of one GPU's latest state (what the next report is compared with)."""

    uuid: str
    verdict: str
    reasons: list[dict[str, Any]] | None  # read only while the GPU FAILs (carried on while that holds)
    xid_count: int


@dataclass
class NodeState:
    """The stored NodeHealth fields the decisions read and change."""

    node_id: int
    verdict: str = Verdict.UNKNOWN.value
    consecutive_ok: int = 0
    drained_by_bcm: bool = False
    drain_reason: str | None = None
    pending_action: str | None = None
    action_attempts: int = 0
    samples_since_prune: int = 0


@dataclass
class Context:
    """What bcm knows of a node when its report arrives; ``stored`` is None before its first report."""

    node_id: int
    name: str
    state: str  # the node's lifecycle state
    thresholds: Thresholds
    expected_gpus: int | None  # what inventory found; None before the first inventory
    stored: NodeState | None
    previous: dict[int, PrevGpu] = field(default_factory=dict)


@dataclass
class Outcome:
    """Everything one report writes, and the decision it records."""

    node_id: int
    name: str
    verdict: str  # effective (a FAIL may hold)
    report_verdict: str  # what this report alone says
    action: str | None  # drain | resume when one was decided
    gpu_rows: list[dict[str, Any]]  # GpuHealth, upserted
    record_row: dict[str, Any]  # HealthRecord (the history), inserted
    events: list[dict[str, Any]]  # HealthEvent, inserted
    node_row: dict[str, Any]  # NodeHealth, upserted
    verdict_changes: list[tuple[int, str]]  # (GPU index, new verdict) for the inventory's Gpu rows
    gone: set[int]  # GPU indexes no longer reported
    prune: bool  # time to trim this node's history

    def advance(self, ctx: Context) -> Context:
        """The context the node's next report meets (a second report of a node in the same batch)."""
        row = self.node_row
        stored = NodeState(**{f.name: row[f.name] for f in dataclasses.fields(NodeState)})
        previous = {
            g["index"]: PrevGpu(g["uuid"], g["verdict"], g["reasons"], g["xid_count"]) for g in self.gpu_rows
        }
        return dataclasses.replace(ctx, stored=stored, previous=previous)


def judge(
    ctx: Context, report: HealthReport, *, resume_after: int, prune_every: int, now: datetime
) -> Outcome:
    """Judge one report of ``ctx``'s node (validated, and known to be from that node)."""
    node_id, name = ctx.node_id, ctx.name
    first = ctx.stored is None
    nh = copy.copy(ctx.stored) if ctx.stored is not None else NodeState(node_id)
    judged = evaluate(report.rules_input(), ctx.thresholds, ctx.expected_gpus)
    raw = judged.verdict
    ok_run = nh.consecutive_ok + 1 if raw in HEALTHY else 0
    was_fail = not first and nh.verdict == Verdict.FAIL.value
    holding = raw is not Verdict.FAIL and was_fail and ok_run < resume_after
    effective = Verdict.FAIL if holding else raw
    held = held_finding(ok_run, resume_after) if holding else None

    samples = {g["index"]: g for g in report.gpus}
    gpu_rows, readings, events, verdict_changes = [], [], [], []
    for gv in judged.gpus:
        prev = ctx.previous.get(gv.index)
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
        readings.append(_reading(uuid, verdict, samples[gv.index], xids))
        events += [
            finding_event(node_id, now, f, gv.index, uuid) for f in gv.reasons if f.code.startswith("xid.")
        ]
        old = prev.verdict if prev else None
        if old != verdict.value and (old is not None or verdict is not Verdict.OK):
            verdict_changes.append((gv.index, verdict.value))
            events.append(_gpu_change_event(node_id, now, gv, uuid, old, verdict))
    events += [finding_event(node_id, now, f) for f in judged.findings if f.code.startswith("xid.")]

    node_findings = [f.to_dict() for f in judged.findings] + ([held.to_dict()] if held else [])
    old_node = None if first else nh.verdict
    if old_node != effective.value and (old_node is not None or effective is not Verdict.OK):
        events.append(_node_change_event(node_id, now, old_node, effective, judged))

    action = decide(nh, ctx.state, was_fail, effective, judged, name, events, now)

    nh.samples_since_prune += 1
    prune = nh.samples_since_prune >= prune_every
    if prune:
        nh.samples_since_prune = 0
    node_row = {
        **vars(nh),  # flat values: no deep copy needed
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
    return Outcome(
        node_id,
        name,
        effective.value,
        raw.value,
        action,
        gpu_rows,
        {"node_id": node_id, "time": now, "gpus": readings},
        events,
        node_row,
        verdict_changes,
        set(ctx.previous) - set(samples),
        prune,
    )


def held_finding(ok_run: int, needed: int) -> Finding:
    return Finding(
        "health.held",
        Verdict.FAIL,
        f"FAIL holds until {needed} healthy reports in a row ({ok_run} so far)",
        Action.NONE,
    )


def decide(
    nh: NodeState,
    state: str,
    was_fail: bool,
    effective: Verdict,
    judged: NodeVerdict,
    name: str,
    events: list[dict[str, Any]],
    now: datetime,
) -> str | None:
    """Record a drain on entering FAIL and a resume on leaving it (bcm's own drains only); changes ``nh``."""
    node_id = nh.node_id
    if effective is Verdict.FAIL and not was_fail:
        if state in DRAINED and not nh.drained_by_bcm:
            message = f"{name} is already {state} by an admin; bcm leaves that drain alone"
            events.append(event_row(node_id, now, "drain.skipped", Verdict.FAIL, message))
            return None
        nh.drained_by_bcm, nh.drain_reason = True, drain_reason(judged)
        nh.pending_action, nh.action_attempts = DRAIN, 0
        events.append(event_row(node_id, now, "drain.requested", Verdict.FAIL, nh.drain_reason, DRAIN))
        return DRAIN
    if was_fail and effective is not Verdict.FAIL and nh.drained_by_bcm:
        if nh.pending_action == DRAIN:  # never carried out: nothing to undo
            nh.pending_action, nh.drained_by_bcm, nh.drain_reason = None, False, None
            return None
        nh.pending_action, nh.action_attempts = RESUME, 0
        message = f"{name} healthy for {nh.consecutive_ok + 1} reports in a row"
        events.append(event_row(node_id, now, "resume.requested", Verdict.OK, message, RESUME))
        return RESUME
    return None


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


# --- rows ---------------------------------------------------------------------------------------------


def event_row(
    node_id: int,
    now: datetime,
    code: str,
    severity: Verdict,
    message: str,
    action: str | None = None,
    gpu_index: int | None = None,
    uuid: str | None = None,
) -> dict[str, Any]:
    """One HealthEvent row (every health event is built here; code and message bounded by their columns)."""
    return {
        "time": now,
        "node_id": node_id,
        "gpu_uuid": uuid,
        "gpu_index": gpu_index,
        "severity": severity.value,
        "code": code[:64],
        "message": message[:1024],
        "action": action,
    }


def finding_event(
    node_id: int, now: datetime, f: Finding, gpu_index: int | None = None, uuid: str | None = None
) -> dict[str, Any]:
    return event_row(node_id, now, f.code, f.severity, f.message, f.action.value, gpu_index, uuid)


def _worst_finding(findings: Sequence[Finding]) -> Finding | None:
    rank = {Verdict.OK: 0, Verdict.UNKNOWN: 1, Verdict.WARN: 2, Verdict.FAIL: 3}
    return max(findings, key=lambda f: rank[f.severity], default=None)


def _gpu_change_event(
    node_id: int, now: datetime, gv: GpuVerdict, uuid: str, old: str | None, new: Verdict
) -> dict[str, Any]:
    top = _worst_finding([r for r in gv.reasons if r.severity is not Verdict.OK])
    why = "; ".join(r.message for r in gv.reasons if r.severity is not Verdict.OK)[:900]
    message = f"GPU {gv.index} {old or 'new'} -> {new.value}" + (f": {why}" if why else "")
    return event_row(
        node_id, now, "gpu.verdict", new, message, top.action.value if top else None, gv.index, uuid
    )


def _node_change_event(
    node_id: int, now: datetime, old: str | None, new: Verdict, judged: NodeVerdict
) -> dict[str, Any]:
    top = _worst_finding(
        [*judged.findings, *(r for g in judged.gpus for r in g.reasons if r.severity is not Verdict.OK)]
    )
    shown = top if top and new is not Verdict.OK else None
    message = f"node {old or 'new'} -> {new.value}" + (f": {shown.message}" if shown else "")
    return event_row(node_id, now, "node.verdict", new, message, shown.action.value if shown else None)


def _gpu_row(
    node_id: int,
    uuid: str,
    verdict: Verdict,
    reasons: list[dict[str, Any]],
    g: GpuSampleIn,
    xids: list[int],
    prev: PrevGpu | None,
    now: datetime,
) -> dict[str, Any]:
    ecc, pcie = g.get("ecc") or _NONE, g.get("pcie") or _NONE
    rows, pages = g.get("remapped_rows") or _NONE, g.get("retired_pages") or _NONE
    return {
        "node_id": node_id,
        "index": g["index"],
        "uuid": uuid[:96],
        "name": g.get("name"),
        "pci_bus_id": (g.get("pci_bus_id") or "")[:32] or None,
        "verdict": verdict.value,
        "reasons": reasons,
        "temperature_c": g.get("temperature_c"),
        "power_draw_w": g.get("power_draw_w"),
        "utilization_gpu_pct": g.get("utilization_gpu_pct"),
        "utilization_memory_pct": g.get("utilization_memory_pct"),
        "memory_total_mib": g.get("memory_total_mib"),
        "memory_used_mib": g.get("memory_used_mib"),
        "ecc_sbe_volatile": ecc.get("volatile_corrected"),
        "ecc_dbe_volatile": ecc.get("volatile_uncorrected"),
        "ecc_sbe_aggregate": ecc.get("aggregate_corrected"),
        "ecc_dbe_aggregate": ecc.get("aggregate_uncorrected"),
        "pcie_replay": pcie.get("replay_counter"),
        "remap_correctable": rows.get("correctable"),
        "remap_uncorrectable": rows.get("uncorrectable"),
        "remap_pending": rows.get("pending"),
        "remap_failure": rows.get("failure"),
        "retired_sbe": pages.get("single_bit"),
        "retired_dbe": pages.get("double_bit"),
        "retired_pending": pages.get("pending"),
        # dcgm-exporter's XID_ERRORS is the last Xid seen; keep it until another one replaces it
        "last_xid": xids[-1] if xids else None,
        "xid_count": min(INT32_MAX, (prev.xid_count if prev else 0) + len(xids)),
        "sampled_at": now,
    }


def _reading(uuid: str, verdict: Verdict, g: GpuSampleIn, xids: list[int]) -> list[Any]:
    """One GPU's values in a HealthRecord, in ``RECORD_FIELDS`` order (bcm.models.health)."""
    ecc = g.get("ecc") or _NONE
    return [
        g["index"],
        uuid[:96],
        verdict.value,
        g.get("temperature_c"),
        g.get("power_draw_w"),
        g.get("utilization_gpu_pct"),
        g.get("memory_used_mib"),
        ecc.get("volatile_corrected"),
        ecc.get("volatile_uncorrected"),
        xids[-1] if xids else None,
    ]
