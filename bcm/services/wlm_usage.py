"""Who runs on which node: the workload-manager sync's cached sample (``WlmUsage``) and its reads.

The sync (``bcm.workers.wlm``) asks each deployed cluster's workload manager for its running work
(:meth:`~bcm.drivers.wlm.WorkloadManager.node_usage`) and :func:`apply` stores it, replacing the
cluster's previous sample; the Nodes page and node JSON read :func:`node_tenants`, the Tenancy page
:func:`account_gpus`. Reads never talk to a workload manager, so a page costs the same at any scale; the
sample is as old as the cluster's ``usage_at``.

Bounds: accounts are cut to the column (``ACCOUNT_MAX``), counts to INT32_MAX, and a node keeps the
``TENANTS_PER_NODE`` accounts holding the most GPUs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from sqlalchemy import delete, func, insert, update
from sqlalchemy import select as sa_select
from sqlmodel import Session, col, select

from bcm.domain.bounds import INT32_MAX
from bcm.drivers.wlm.base import NodeUsage
from bcm.errors import NotFound
from bcm.models.base import utcnow
from bcm.models.node import Node, TenantUse
from bcm.models.wlm import ACCOUNT_MAX, TENANTS_PER_NODE, WlmCluster, WlmMember, WlmUsage

CHUNK = 500


def _cluster(session: Session, name: str) -> WlmCluster:
    row = session.exec(select(WlmCluster).where(WlmCluster.name == name)).first()
    if row is None:
        raise NotFound(f"workload-manager cluster {name!r} not found")
    return row


def bounded(usage: Iterable[NodeUsage], node_ids: dict[str, int]) -> dict[tuple[int, str], tuple[int, int]]:
    """(node id, account) -> (GPUs, jobs) for the cluster's own nodes, each value bounded by its column and
    each node by ``TENANTS_PER_NODE`` (most GPUs, then most jobs, then by name)."""
    summed: dict[tuple[int, str], tuple[int, int]] = {}
    for u in usage:
        nid = node_ids.get(u.node)
        account = " ".join(u.account.split())[:ACCOUNT_MAX]
        if nid is None or not account:
            continue  # a node bcm does not count among the cluster's members
        gpus, jobs = summed.get((nid, account), (0, 0))
        summed[(nid, account)] = (
            min(INT32_MAX, gpus + max(0, u.gpus)),
            min(INT32_MAX, jobs + max(0, u.jobs)),
        )
    by_node: dict[int, list[tuple[str, tuple[int, int]]]] = {}
    for (nid, account), value in summed.items():
        by_node.setdefault(nid, []).append((account, value))
    kept: dict[tuple[int, str], tuple[int, int]] = {}
    for nid, items in by_node.items():
        items.sort(key=lambda item: (-item[1][0], -item[1][1], item[0]))
        kept.update({(nid, account): value for account, value in items[:TENANTS_PER_NODE]})
    return kept


def apply(session: Session, cluster: str, usage: Sequence[NodeUsage]) -> int:
    """Replace the cluster's sample with ``usage`` (rows written only where they changed); the rows changed."""
    row = _cluster(session, cluster)
    node_ids = dict(
        session.exec(
            select(Node.name, Node.id)
            .join(WlmMember, col(WlmMember.node_id) == col(Node.id))
            .where(WlmMember.cluster_id == row.id)
        ).all()
    )
    want = bounded(usage, {name: nid for name, nid in node_ids.items() if nid is not None})
    members = select(WlmMember.node_id).where(WlmMember.cluster_id == row.id)
    # rows a member left behind in a cluster it has since left (a node is in one cluster at a time)
    session.execute(
        delete(WlmUsage).where(col(WlmUsage.node_id).in_(members), col(WlmUsage.cluster_id) != row.id)
    )
    # plain rows and bulk statements: an unchanged sample of 10,000 nodes writes nothing, and no ORM
    # object is made per row every 30 s
    have = {
        (nid, account): (uid, gpus, jobs)
        for uid, nid, account, gpus, jobs in session.execute(
            sa_select(
                col(WlmUsage.id),
                col(WlmUsage.node_id),
                col(WlmUsage.account),
                col(WlmUsage.gpus),
                col(WlmUsage.jobs),
            ).where(col(WlmUsage.cluster_id) == row.id)
        )
    }
    gone = [uid for key, (uid, _g, _j) in have.items() if key not in want]
    moved = [
        {"id": uid, "gpus": want[key][0], "jobs": want[key][1]}
        for key, (uid, gpus, jobs) in have.items()
        if key in want and (gpus, jobs) != want[key]
    ]
    new = [
        {"cluster_id": row.id, "node_id": nid, "account": account, "gpus": gpus, "jobs": jobs}
        for (nid, account), (gpus, jobs) in want.items()
        if (nid, account) not in have
    ]
    for i in range(0, len(gone), CHUNK):
        session.execute(delete(WlmUsage).where(col(WlmUsage.id).in_(gone[i : i + CHUNK])))
    if moved:
        session.execute(update(WlmUsage), moved)  # by primary key
    if new:
        session.execute(insert(WlmUsage), new)
    changed = len(gone) + len(moved) + len(new)
    row.usage_at = utcnow()
    session.add(row)
    session.flush()
    return changed


def keep_only(session: Session, clusters: Sequence[str]) -> int:
    """Drop the samples of every cluster but ``clusters`` (those the sync still reads); the rows dropped."""
    others = col(WlmCluster.name).not_in(list(clusters))
    result = session.execute(
        delete(WlmUsage).where(col(WlmUsage.cluster_id).in_(select(WlmCluster.id).where(others)))
    )
    session.execute(
        update(WlmCluster).where(others, col(WlmCluster.usage_at).is_not(None)).values(usage_at=None)
    )
    return int(getattr(result, "rowcount", 0) or 0)


def node_tenants(session: Session, node_ids: Sequence[int | None]) -> dict[int, list[TenantUse]]:
    """Each node's accounts, most GPUs first (one query per 500 nodes)."""
    ids = [i for i in node_ids if i is not None]
    out: dict[int, list[TenantUse]] = {}
    for i in range(0, len(ids), CHUNK):
        stmt = (
            select(WlmUsage.node_id, WlmUsage.account, WlmUsage.gpus, WlmUsage.jobs)
            .where(col(WlmUsage.node_id).in_(ids[i : i + CHUNK]))
            .order_by(col(WlmUsage.node_id), col(WlmUsage.gpus).desc(), col(WlmUsage.account))
        )
        for nid, account, gpus, jobs in session.exec(stmt):
            out.setdefault(nid, []).append(TenantUse(account=account, gpus=gpus, jobs=jobs))
    return out


def account_gpus(session: Session) -> dict[str, int]:
    """GPUs each account's running work holds across every cluster (one grouped query)."""
    stmt = select(WlmUsage.account, func.sum(WlmUsage.gpus)).group_by(col(WlmUsage.account))
    return {account: int(total or 0) for account, total in session.exec(stmt)}


def sampled(session: Session) -> list[tuple[str, datetime | None]]:
    """Each cluster and when its usage was last sampled (None: never)."""
    return list(
        session.exec(select(WlmCluster.name, WlmCluster.usage_at).order_by(col(WlmCluster.name))).all()
    )
