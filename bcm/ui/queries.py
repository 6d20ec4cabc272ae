"""The dashboard's own reads: the Nodes table (filters, sort, paging) and the Overview's counts.

What a service already answers is asked of it (node views: ``services.nodes.to_public``; health:
``services.health_queries``); what is here is only what no API route needs: sorting by any column, the
health filter beside state and category, and per-page joins (GPU verdicts, clusters) for one page of ids.
Every query is bounded by the page, or is a grouped count over an indexed column.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import func, or_
from sqlalchemy import select as sa_select
from sqlalchemy.orm import defer
from sqlmodel import Session, col

from bcm.domain.health import Verdict
from bcm.domain.naming import expand_hostlist
from bcm.domain.states import State
from bcm.errors import InvalidInput
from bcm.models.category import Category
from bcm.models.gpu import Gpu
from bcm.models.health import RECORD_FIELDS, GpuHealth, HealthRecord, NodeHealth
from bcm.models.node import Node, NodePublic
from bcm.models.operation import Operation, OpState
from bcm.models.wlm import WlmCluster, WlmMember
from bcm.services import health_queries
from bcm.services import nodes as node_svc

CHUNK = 500
PAGE_SIZES = (25, 50, 100, 200, 500)
VERDICT_ORDER = {"FAIL": 0, "WARN": 1, "UNKNOWN": 2, "OK": 3}


@dataclass
class NodeFilter:
    nodes: str | None = None  # hostlist
    state: str | None = None
    category: str | None = None
    health: str | None = None  # OK, WARN, FAIL, UNKNOWN (no report counts as UNKNOWN)
    sort: str = "name"
    desc: bool = False

    def params(self) -> dict[str, str]:
        out = {
            k: v
            for k, v in (
                ("nodes", self.nodes),
                ("state", self.state),
                ("category", self.category),
                ("health", self.health),
            )
            if v
        }
        if self.sort != "name":
            out["sort"] = self.sort
        if self.desc:
            out["dir"] = "desc"
        return out


@dataclass
class NodeRow:
    node: NodePublic
    health: str
    drain_reason: str | None
    gpu_verdicts: dict[str, int] = field(default_factory=dict)
    clusters: list[str] = field(default_factory=list)

    @property
    def gpus(self) -> int:
        """GPUs inventoried, or (before an inventory) those the agent reports."""
        return self.node.gpu_count or sum(self.gpu_verdicts.values())

    @property
    def gpu_health(self) -> str:
        """The worst GPU verdict first: ``1 FAIL · 7 OK``."""
        parts = sorted(self.gpu_verdicts.items(), key=lambda kv: VERDICT_ORDER.get(kv[0], 9))
        return " · ".join(f"{n} {v}" for v, n in parts) if parts else "–"

    @property
    def worst_gpu(self) -> str:
        return (
            min(self.gpu_verdicts, key=lambda v: VERDICT_ORDER.get(v, 9)) if self.gpu_verdicts else "UNKNOWN"
        )


def _gpu_counts() -> Any:
    return (
        sa_select(col(Gpu.node_id).label("node_id"), func.count().label("n"))
        .group_by(col(Gpu.node_id))
        .subquery()
    )


SORTS = ("name", "state", "power", "category", "image", "running", "gpus", "health", "wlm")


def _filtered(session: Session, f: NodeFilter, *, needs_health: bool) -> Any:
    stmt = sa_select(Node).options(defer(Node.facts), defer(Node.ssh_host_key))  # type: ignore[arg-type]
    if needs_health:
        stmt = stmt.outerjoin(NodeHealth, col(NodeHealth.node_id) == col(Node.id))
    if f.state:
        try:
            State(f.state)
        except ValueError:
            raise InvalidInput(f"state: unknown state {f.state!r}", field="state") from None
        stmt = stmt.where(col(Node.provision_state) == f.state)
    if f.category:
        cat = session.execute(sa_select(col(Category.id)).where(col(Category.name) == f.category)).scalar()
        if cat is None:
            raise InvalidInput(f"category: unknown category {f.category!r}", field="category")
        stmt = stmt.where(col(Node.category_id) == cat)
    if f.health:
        wanted = health_queries.parse_verdict(f.health, "health")
        if wanted == Verdict.UNKNOWN.value:
            stmt = stmt.where(or_(col(NodeHealth.verdict) == wanted, col(NodeHealth.node_id).is_(None)))
        else:
            stmt = stmt.where(col(NodeHealth.verdict) == wanted)
    if f.nodes:
        names = expand_hostlist(f.nodes, "nodes")
        stmt = stmt.where(
            or_(*[col(Node.name).in_(names[i : i + CHUNK]) for i in range(0, len(names), CHUNK)])
        )
    return stmt


def node_page(session: Session, f: NodeFilter, *, limit: int, offset: int) -> tuple[list[NodeRow], int]:
    """One page of the Nodes table and the number of nodes matching the filter."""
    if f.sort not in SORTS:
        raise InvalidInput(f"sort: one of {', '.join(SORTS)}", field="sort")
    needs_health = bool(f.health) or f.sort == "health"
    stmt = _filtered(session, f, needs_health=needs_health)
    total = int(session.execute(sa_select(func.count()).select_from(stmt.subquery())).scalar_one())
    key: Any
    if f.sort == "category":
        stmt = stmt.outerjoin(Category, col(Category.id) == col(Node.category_id))
        key = col(Category.name)
    elif f.sort == "gpus":
        counts = _gpu_counts()
        stmt = stmt.outerjoin(counts, counts.c.node_id == col(Node.id))
        key = func.coalesce(counts.c.n, 0)
    elif f.sort == "health":
        key = func.coalesce(col(NodeHealth.verdict), "UNKNOWN")
    else:
        key = col(
            {
                "name": Node.name,
                "state": Node.provision_state,
                "power": Node.power_state,
                "image": Node.image,
                "running": Node.running_image,
                "wlm": Node.wlm_state,
            }[f.sort]
        )
    order = [key.desc() if f.desc else key.asc()]
    if f.sort != "name":
        order.append(col(Node.name).asc())
    nodes = list(session.execute(stmt.order_by(*order).offset(offset).limit(limit)).scalars())
    return rows_for(session, nodes), total


def matching_names(session: Session, f: NodeFilter, limit: int = 20_000) -> list[str]:
    """The names of every node the filter matches (a bulk action on "all matching"), by name."""
    stmt = _filtered(session, f, needs_health=bool(f.health)).with_only_columns(col(Node.name))
    return list(session.execute(stmt.order_by(col(Node.name)).limit(limit)).scalars())


def rows_for(session: Session, nodes: Sequence[Node]) -> list[NodeRow]:
    views = node_svc.to_public(session, nodes)
    ids = [n.id for n in nodes if n.id is not None]
    health: dict[int, tuple[str, str | None]] = {}
    verdicts: dict[int, dict[str, int]] = {}
    clusters: dict[int, list[str]] = {}
    for i in range(0, len(ids), CHUNK):
        chunk = ids[i : i + CHUNK]
        q = sa_select(col(NodeHealth.node_id), col(NodeHealth.verdict), col(NodeHealth.drain_reason))
        for nid, verdict, reason in session.execute(q.where(col(NodeHealth.node_id).in_(chunk))):
            health[nid] = (verdict, reason)
        g = (
            sa_select(col(GpuHealth.node_id), col(GpuHealth.verdict), func.count())
            .where(col(GpuHealth.node_id).in_(chunk))
            .group_by(col(GpuHealth.node_id), col(GpuHealth.verdict))
        )
        for nid, verdict, n in session.execute(g):
            verdicts.setdefault(nid, {})[verdict] = int(n)
        m = (
            sa_select(col(WlmMember.node_id), col(WlmCluster.name))
            .join(WlmCluster, col(WlmCluster.id) == col(WlmMember.cluster_id))
            .where(col(WlmMember.node_id).in_(chunk))
        )
        for nid, cname in session.execute(m):
            clusters.setdefault(nid, []).append(cname)
    out = []
    for n, view in zip(nodes, views, strict=True):
        verdict, reason = health.get(n.id or 0, ("UNKNOWN", None))
        out.append(
            NodeRow(view, verdict, reason, verdicts.get(n.id or 0, {}), sorted(clusters.get(n.id or 0, [])))
        )
    return out


def states(session: Session) -> dict[str, int]:
    """Nodes by lifecycle state (a grouped count over an indexed column)."""
    q = sa_select(col(Node.provision_state), func.count()).group_by(col(Node.provision_state))
    return {s: int(n) for s, n in session.execute(q)}


def categories(session: Session) -> list[str]:
    return list(session.execute(sa_select(col(Category.name)).order_by(col(Category.name))).scalars())


def running_operations(session: Session, limit: int = 20) -> list[Operation]:
    q = (
        sa_select(Operation)
        .where(col(Operation.state).in_([OpState.PENDING.value, OpState.RUNNING.value]))
        .order_by(col(Operation.id).desc())
        .limit(limit)
    )
    return list(session.execute(q).scalars())


def cluster_sizes(session: Session) -> dict[int, int]:
    """Member nodes per workload-manager cluster id (one grouped count, not the members' names)."""
    q = sa_select(col(WlmMember.cluster_id), func.count()).group_by(col(WlmMember.cluster_id))
    return {cid: int(n) for cid, n in session.execute(q)}


class Reading(NamedTuple):
    """One GPU's values in one report, as the charts draw them."""

    time: datetime
    temperature_c: int | None
    power_draw_w: float | None
    ecc_sbe_volatile: int | None
    ecc_dbe_volatile: int | None
    xid: int | None


_AT = {name: i for i, name in enumerate(RECORD_FIELDS)}


def node_readings(session: Session, node_id: int, limit: int) -> dict[str, list[Reading]]:
    """Every GPU's readings in the node's last ``limit`` reports (the history kept), newest first, by UUID.

    ``health_queries.gpu_history`` answers one GPU (the API's route): asked once per GPU it reads the
    node's records eight times and validates every sample into a model, 0.3-0.6 s for eight GPUs with
    1,000 reports kept; this reads them once, as plain tuples, for all the node's GPUs at once.
    """
    rows = session.execute(
        sa_select(col(HealthRecord.time), col(HealthRecord.gpus))
        .where(col(HealthRecord.node_id) == node_id)
        .order_by(col(HealthRecord.id).desc())
        .limit(limit)
    )
    at = _AT
    width = len(RECORD_FIELDS)
    out: dict[str, list[Reading]] = {}
    for time, gpus in rows:
        for g in gpus:
            if len(g) < width:
                g = list(g) + [None] * (width - len(g))
            out.setdefault(str(g[at["uuid"]]), []).append(
                Reading(
                    time,
                    g[at["temperature_c"]],
                    g[at["power_draw_w"]],
                    g[at["ecc_sbe_volatile"]],
                    g[at["ecc_dbe_volatile"]],
                    g[at["xid"]],
                )
            )
    return out
