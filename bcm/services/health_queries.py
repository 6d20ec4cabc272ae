"""GPU health queries: the cluster summary, nodes by verdict, a node's GPUs, a GPU's history, events.

Everything reads the one-row-per-node and one-row-per-GPU tables (``NodeHealth``, ``GpuHealth``) with
grouped counts over indexed columns, never the history, so the summary stays cheap at 10,000 nodes.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

from sqlalchemy import func, or_
from sqlalchemy import select as sa_select
from sqlmodel import Session, col

from bcm.domain.health import Verdict
from bcm.domain.naming import expand_hostlist
from bcm.errors import Conflict, InvalidInput, NotFound
from bcm.models.base import utcnow
from bcm.models.gpu import Gpu
from bcm.models.health import (
    RECORD_FIELDS,
    GpuHealth,
    GpuHealthPublic,
    GpuHistory,
    HealthEvent,
    HealthEventPublic,
    HealthRecord,
    HealthSamplePublic,
    HealthSummary,
    NodeHealth,
    NodeHealthPage,
    NodeHealthPublic,
)
from bcm.models.node import Node
from bcm.services.health import node_id_of, stale_cutoff
from bcm.settings import HealthSettings

CHUNK = 500
VERDICTS = [v.value for v in Verdict]
FAILING_SHOWN = 100


def parse_verdict(value: str | None, field: str = "verdict") -> str | None:
    if value is None:
        return None
    upper = value.upper() if value.isascii() else value  # ASCII only, as VERDICT_PATTERN documents it
    if upper not in VERDICTS:
        raise InvalidInput(f"{field}: unknown verdict {value!r} (one of {', '.join(VERDICTS)})", field=field)
    return upper


def summary(session: Session, settings: HealthSettings, now: datetime | None = None) -> HealthSummary:
    """Counts of nodes and GPUs by verdict; nodes that never reported count as UNKNOWN."""
    now = now or utcnow()
    total = int(session.execute(sa_select(func.count(col(Node.id)))).scalar_one())
    by_verdict = {v: 0 for v in VERDICTS}
    reported = 0
    for verdict, count in session.execute(
        sa_select(col(NodeHealth.verdict), func.count()).group_by(col(NodeHealth.verdict))
    ):
        by_verdict[verdict] = by_verdict.get(verdict, 0) + int(count)
        reported += int(count)
    never = max(0, total - reported)
    by_verdict[Verdict.UNKNOWN.value] += never
    stale = int(
        session.execute(
            sa_select(func.count()).where(col(NodeHealth.last_report_at) < stale_cutoff(settings, now))
        ).scalar_one()
    )
    drained = int(
        session.execute(sa_select(func.count()).where(col(NodeHealth.drained_by_bcm).is_(True))).scalar_one()
    )
    gpus = {v: 0 for v in VERDICTS}
    for verdict, count in session.execute(
        sa_select(col(GpuHealth.verdict), func.count()).group_by(col(GpuHealth.verdict))
    ):
        gpus[verdict] = gpus.get(verdict, 0) + int(count)
    failing = session.execute(
        sa_select(col(Node.name))
        .join(NodeHealth, col(NodeHealth.node_id) == col(Node.id))
        .where(col(NodeHealth.verdict) == Verdict.FAIL.value)
        .order_by(col(Node.name))
        .limit(FAILING_SHOWN)
    ).scalars()
    return HealthSummary(
        nodes=total,
        nodes_by_verdict=by_verdict,
        nodes_never_reported=never,
        nodes_stale=stale,
        nodes_drained_by_bcm=drained,
        gpus=sum(gpus.values()),
        gpus_by_verdict=gpus,
        failing=list(failing),
        interval_s=settings.interval_s,
        generated_at=now,
    )


def list_nodes(
    session: Session,
    settings: HealthSettings,
    *,
    verdict: str | None = None,
    hostlist: str | None = None,
    limit: int = 100,
    offset: int = 0,
    now: datetime | None = None,
) -> NodeHealthPage:
    """Nodes with their health, by name; ``verdict=UNKNOWN`` includes nodes that never reported."""
    now = now or utcnow()
    wanted = parse_verdict(verdict)
    stmt = sa_select(Node, NodeHealth).outerjoin(NodeHealth, col(NodeHealth.node_id) == col(Node.id))
    if wanted == Verdict.UNKNOWN.value:
        stmt = stmt.where(or_(col(NodeHealth.verdict) == wanted, col(NodeHealth.node_id).is_(None)))
    elif wanted:
        stmt = stmt.where(col(NodeHealth.verdict) == wanted)
    if hostlist:
        names = expand_hostlist(hostlist, "nodes")
        stmt = stmt.where(
            or_(*[col(Node.name).in_(names[i : i + CHUNK]) for i in range(0, len(names), CHUNK)])
        )
    total = int(session.execute(sa_select(func.count()).select_from(stmt.subquery())).scalar_one())
    rows = session.execute(stmt.order_by(col(Node.name)).offset(offset).limit(limit)).all()
    cutoff = stale_cutoff(settings, now)
    items = [_node_public(node, nh, cutoff) for node, nh in rows]
    return NodeHealthPage(items=items, total=total, limit=limit, offset=offset)


def _node_public(node: Node, nh: NodeHealth | None, cutoff: datetime) -> NodeHealthPublic:
    if nh is None:
        return NodeHealthPublic(
            name=node.name,
            verdict=Verdict.UNKNOWN.value,
            report_verdict=None,
            last_report_at=None,
            stale=True,
            consecutive_ok=0,
            gpu_count=0,
            drained_by_bcm=False,
            drain_reason=None,
            provision_state=node.provision_state,
            findings=[
                {"code": "report.missing", "severity": "UNKNOWN", "message": "no health report received yet"}
            ],
        )
    return NodeHealthPublic(
        name=node.name,
        verdict=nh.verdict,
        report_verdict=nh.report_verdict,
        last_report_at=nh.last_report_at,
        stale=nh.last_report_at is None or nh.last_report_at < cutoff,
        consecutive_ok=nh.consecutive_ok,
        gpu_count=nh.gpu_count,
        drained_by_bcm=nh.drained_by_bcm,
        drain_reason=nh.drain_reason,
        provision_state=node.provision_state,
        findings=nh.findings or [],
    )


def node_gpus(session: Session, name: str) -> list[GpuHealthPublic]:
    """A node's GPUs: their latest health, plus inventoried GPUs that no report has covered (UNKNOWN)."""
    node_id = node_id_of(session, name)
    rows = session.execute(
        sa_select(GpuHealth).where(col(GpuHealth.node_id) == node_id).order_by(col(GpuHealth.index))
    ).scalars()
    out = {g.index: _gpu_public(name, g) for g in rows}
    for inv in session.execute(sa_select(Gpu).where(col(Gpu.node_id) == node_id)).scalars():
        if inv.index not in out:
            out[inv.index] = GpuHealthPublic(
                node=name,
                index=inv.index,
                uuid=inv.uuid,
                name=inv.name,
                pci_bus_id=inv.pci_bus_id,
                verdict=Verdict.UNKNOWN.value,
                reasons=[],
                temperature_c=None,
                power_draw_w=None,
                utilization_gpu_pct=None,
                memory_total_mib=inv.memory_mib,
                memory_used_mib=None,
                ecc_sbe_volatile=None,
                ecc_dbe_volatile=None,
                last_xid=None,
                xid_count=0,
                sampled_at=inv.updated_at,
            )
    return [out[i] for i in sorted(out)]


def _gpu_public(node: str, g: GpuHealth) -> GpuHealthPublic:
    return GpuHealthPublic(
        node=node,
        **g.model_dump(
            include={
                "index",
                "uuid",
                "name",
                "pci_bus_id",
                "verdict",
                "temperature_c",
                "power_draw_w",
                "utilization_gpu_pct",
                "memory_total_mib",
                "memory_used_mib",
                "ecc_sbe_volatile",
                "ecc_dbe_volatile",
                "last_xid",
                "xid_count",
                "sampled_at",
            }
        ),
        reasons=g.reasons or [],
    )


def gpu_history(
    session: Session, uuid: str, *, node: str | None = None, limit: int = 100, since: datetime | None = None
) -> GpuHistory:
    """A GPU's samples, newest first, from the one node that reports it (``node`` names it when
    several nodes have reported the same UUID: each node's history is its own)."""
    reporters = (
        sa_select(GpuHealth.node_id, GpuHealth.index, Node.name)  # type: ignore[call-overload]
        .join(Node, col(Node.id) == col(GpuHealth.node_id))
        .where(col(GpuHealth.uuid) == uuid)
    )
    if node:
        reporters = reporters.where(col(GpuHealth.node_id) == node_id_of(session, node))
    found = session.execute(reporters.limit(11)).all()
    if len(found) > 1:
        names = ", ".join(sorted(r[2] for r in found[:10]))
        raise Conflict(f"GPU UUID {uuid!r} is reported by several nodes ({names}); name one with ?node=")
    if found:
        node_id, index, node_name = found[0]
    elif node:
        node_id, index, node_name = node_id_of(session, node), None, node
    else:
        raise NotFound(f"no GPU with UUID {uuid!r} has reported")
    samples = _readings(session, node_id, uuid, limit, since)
    if not found and not samples:
        raise NotFound(f"no GPU with UUID {uuid!r} has reported from node {node!r}")
    return GpuHistory(uuid=uuid, node=node_name, index=index, samples=samples)


def _readings(
    session: Session, node_id: int, uuid: str, limit: int, since: datetime | None
) -> list[HealthSamplePublic]:
    """The GPU's readings in its node's records, newest first: pages of records by id until ``limit``
    readings are found or the node's records (at most ``history_per_gpu`` and a pruning period) run out.
    The first page is ``limit`` records (a GPU is in nearly every report); later ones ``CHUNK`` or more."""
    at = RECORD_FIELDS.index("uuid")
    samples: list[HealthSamplePublic] = []
    before: int | None = None
    page = limit
    while len(samples) < limit:  # bounded: every page starts below the last one's ids
        stmt = sa_select(col(HealthRecord.id), col(HealthRecord.time), col(HealthRecord.gpus))
        stmt = stmt.where(col(HealthRecord.node_id) == node_id)
        if since is not None:
            stmt = stmt.where(col(HealthRecord.time) >= since)
        if before is not None:
            stmt = stmt.where(col(HealthRecord.id) < before)
        rows = session.execute(stmt.order_by(col(HealthRecord.id).desc()).limit(page)).all()
        for _id, time, gpus in rows:
            reading = next((g for g in gpus if len(g) > at and g[at] == uuid), None)
            if reading is not None:
                values = dict.fromkeys(RECORD_FIELDS) | dict(zip(RECORD_FIELDS, reading, strict=False))
                samples.append(HealthSamplePublic.model_validate({**values, "time": time}))
                if len(samples) == limit:
                    break
        if len(rows) < page:
            break
        before, page = rows[-1][0], max(limit, CHUNK)
    return samples


def events(
    session: Session,
    *,
    since: datetime | None = None,
    node: str | None = None,
    severity: str | None = None,
    limit: int = 100,
    offset: int = 0,
) -> list[HealthEventPublic]:
    """Health events, newest first."""
    stmt = sa_select(HealthEvent, Node.name).join(Node, col(Node.id) == col(HealthEvent.node_id))  # type: ignore[call-overload]
    if since is not None:
        stmt = stmt.where(col(HealthEvent.time) >= since)
    if node:
        stmt = stmt.where(col(HealthEvent.node_id) == node_id_of(session, node))
    wanted = parse_verdict(severity, "severity")
    if wanted:
        stmt = stmt.where(col(HealthEvent.severity) == wanted)
    rows = session.execute(stmt.order_by(col(HealthEvent.id).desc()).offset(offset).limit(limit)).all()
    return [
        HealthEventPublic(node=name, **e.model_dump(exclude={"node_id"}))  # type: ignore[arg-type]
        for e, name in rows
    ]


def metric_rows(session: Session, hostlist: str | None = None) -> Iterator[tuple[str, GpuHealth]]:
    """(hostname, latest GPU state) for every reporting GPU, by node name and index, streamed."""
    stmt = sa_select(Node.name, GpuHealth).join(Node, col(Node.id) == col(GpuHealth.node_id))  # type: ignore[call-overload]
    if hostlist:
        names = expand_hostlist(hostlist, "nodes")
        stmt = stmt.where(
            or_(*[col(Node.name).in_(names[i : i + CHUNK]) for i in range(0, len(names), CHUNK)])
        )
    for name, gpu in session.execute(stmt.order_by(col(Node.name), col(GpuHealth.index))).yield_per(2000):
        yield str(name), gpu


def node_metric_rows(session: Session, hostlist: str | None = None) -> list[tuple[str, NodeHealth]]:
    stmt = sa_select(Node.name, NodeHealth).join(Node, col(Node.id) == col(NodeHealth.node_id))  # type: ignore[call-overload]
    if hostlist:
        names = expand_hostlist(hostlist, "nodes")
        stmt = stmt.where(
            or_(*[col(Node.name).in_(names[i : i + CHUNK]) for i in range(0, len(names), CHUNK)])
        )
    return [(n, h) for n, h in session.execute(stmt.order_by(col(Node.name))).all()]


__all__ = [
    "events",
    "gpu_history",
    "list_nodes",
    "metric_rows",
    "node_gpus",
    "node_metric_rows",
    "parse_verdict",
    "summary",
]
