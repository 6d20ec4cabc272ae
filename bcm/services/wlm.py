"""Workload-manager use cases on the database: plan a deploy, gather what the workload manager renders
its files from, record outcomes, map nodes to clusters (through ``wlm_member``), apply the workload
manager's node states. The SSH/Ansible work is in ``bcm.workers.wlm``; what is particular to Slurm is
behind ``bcm.drivers.wlm``, picked by the cluster's kind.

Secrets live in 0600 files under ``<state_dir>/wlm/<cluster>/`` (directory 0700), not in the
database: an encryption key would have to sit in that same state directory, so encrypting would
protect nothing more, while files keep the secrets out of database dumps and API responses, and the
Ansible roles copy them with ``src:`` so they never become variables or log lines.

Services flush but never commit: the request or background job owns the transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import delete
from sqlmodel import Session, col, select

from bcm.domain.naming import expand_hostlist, fold_hostlist
from bcm.domain.states import State, Verb, next_state
from bcm.drivers import wlm
from bcm.errors import Conflict, NotFound
from bcm.models.base import utcnow
from bcm.models.category import Category
from bcm.models.gpu import Gpu
from bcm.models.node import Interface, Node
from bcm.models.wlm import (
    WlmCluster,
    WlmClusterDetail,
    WlmClusterPublic,
    WlmDeployRequest,
    WlmMember,
    WlmNodePublic,
    WlmRole,
    WlmState,
)
from bcm.services import events, tenancy
from bcm.services import nodes as node_svc
from bcm.services.render import render

_GONE = {State.RETIRED.value, State.DISCOVERED.value}
_LIVE = (WlmState.DEPLOYED.value, WlmState.PARTIAL.value)  # clusters whose nodes are drained through them
_CHUNK = 500  # IN (...) lists stay under every backend's bound-parameter limit


def secrets_dir(state_dir: Path, cluster: str) -> Path:
    return state_dir / "wlm" / cluster


def keep_secrets(state_dir: Path, kind: str, req: WlmDeployRequest) -> None:
    """The write-only values of a deploy request, in the cluster's secrets directory."""
    wlm.get(kind).keep_secrets(secrets_dir(state_dir, req.name), req.secrets())


def remove(session: Session, name: str, actor: str) -> None:
    """Forget a cluster: its row and memberships (its nodes stay registered, their daemons untouched);
    409 while a deploy runs. The caller removes the secrets directory once this is committed."""
    row = get(session, name)
    if row.state == WlmState.DEPLOYING:
        raise Conflict(f"cluster {name} is deploying: wait for the operation to finish")
    members = member_names(session, row)
    session.execute(delete(WlmMember).where(col(WlmMember.cluster_id) == row.id))
    session.delete(row)
    events.record(
        session, actor, "wlm.remove", name, f"{row.kind} cluster forgotten ({fold_hostlist(members)})"
    )
    session.flush()


def _chunks(items: Sequence[Any]) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), _CHUNK):
        yield items[i : i + _CHUNK]


def _in_order(names: Iterable[str]) -> list[str]:
    """Names in hostlist order (``gpu2`` before ``gpu10``), as the folded hostlist lists them."""
    names = list(names)
    return expand_hostlist(fold_hostlist(names)) if names else []


# ---- clusters ---------------------------------------------------------------------------------------


def get(session: Session, name: str) -> WlmCluster:
    row = session.exec(select(WlmCluster).where(WlmCluster.name == name)).first()
    if row is None:
        raise NotFound(
            f"workload-manager cluster {name!r} not found (deploy one with `bcm wlm deploy slurm`)"
        )
    return row


def query(session: Session) -> list[WlmCluster]:
    return list(session.exec(select(WlmCluster).order_by(col(WlmCluster.name))))


def pick(session: Session, name: str | None) -> WlmCluster:
    """The named cluster, or the only one when no name is given."""
    if name:
        return get(session, name)
    rows = query(session)
    if len(rows) == 1:
        return rows[0]
    if not rows:
        raise NotFound("no workload-manager cluster yet (deploy one with `bcm wlm deploy slurm`)")
    raise Conflict(f"several clusters ({', '.join(r.name for r in rows)}); name one")


def _addresses(session: Session, nodes: list[Node]) -> dict[str, str | None]:
    by_id: dict[int, list[Interface]] = {}
    ids = [n.id for n in nodes]
    for i in session.exec(select(Interface).where(col(Interface.node_id).in_(ids))):
        by_id.setdefault(i.node_id, []).append(i)
    out = {}
    for n in nodes:
        ifaces = sorted(by_id.get(n.id or 0, []), key=lambda i: (not i.boot, i.id or 0))
        out[n.name] = next((i.ip for i in ifaces if i.ip), None)
    return out


def _check_deployable(session: Session, nodes: list[Node], role: str) -> dict[str, str | None]:
    """409 naming every node that is not inventoried, has no address or no pinned host key."""
    not_inv = [n.name for n in nodes if n.inventoried_at is None or not n.facts or n.provision_state in _GONE]
    if not_inv:
        raise Conflict(
            f"{role}: not inventoried: {fold_hostlist(not_inv)} (run `bcm node inventory {fold_hostlist(not_inv)}`)"
        )
    addrs = _addresses(session, nodes)
    no_addr = [n for n, a in addrs.items() if not a]
    if no_addr:
        raise Conflict(f"{role}: no IP address registered for {fold_hostlist(no_addr)}")
    no_key = [n.name for n in nodes if not n.ssh_host_key]
    if no_key:
        raise Conflict(f"{role}: no pinned SSH host key for {fold_hostlist(no_key)}")
    return addrs


def members(session: Session, row: WlmCluster) -> list[Node]:
    """The cluster's compute nodes (what its hostlist names), in hostlist order."""
    stmt = (
        select(Node)
        .join(WlmMember, col(WlmMember.node_id) == col(Node.id))
        .where(WlmMember.cluster_id == row.id, WlmMember.role == WlmRole.COMPUTE.value)
    )
    by_name = {n.name: n for n in session.exec(stmt)}
    return [by_name[n] for n in _in_order(by_name)]


def nodes_with_gpus(session: Session, node_ids: list[int]) -> set[int]:
    """Which of these nodes have inventoried GPUs."""
    if not node_ids:
        return set()
    return set(session.exec(select(Gpu.node_id).where(col(Gpu.node_id).in_(node_ids)).distinct()))


def member_names(session: Session, row: WlmCluster) -> list[str]:
    stmt = (
        select(Node.name)
        .join(WlmMember, col(WlmMember.node_id) == col(Node.id))
        .where(WlmMember.cluster_id == row.id, WlmMember.role == WlmRole.COMPUTE.value)
    )
    return _in_order(session.exec(stmt))


def hostlist(session: Session, row: WlmCluster) -> str:
    """The cluster's compute members folded (``gpu[01-16]``); "" for none."""
    names = member_names(session, row)
    return fold_hostlist(names) if names else ""


def _others(session: Session, cluster_id: int | None, node_ids: list[int | None]) -> dict[str, str]:
    """node name -> name of the other cluster it belongs to, for those of ``node_ids`` that do."""
    out: dict[str, str] = {}
    for chunk in _chunks(node_ids):
        stmt = (
            select(Node.name, WlmCluster.name)
            .join(WlmMember, col(WlmMember.node_id) == col(Node.id))
            .join(WlmCluster, col(WlmCluster.id) == col(WlmMember.cluster_id))
            .where(col(WlmMember.node_id).in_(chunk))
        )
        if cluster_id is not None:
            stmt = stmt.where(WlmMember.cluster_id != cluster_id)
        out.update(dict(session.exec(stmt).all()))
    return out


def _check_free(session: Session, cluster: WlmCluster | None, controller: Node, nodes: list[Node]) -> None:
    """409 for nodes (or the controller) that belong to another cluster: a node is in at most one."""
    others = _others(session, cluster.id if cluster else None, [n.id for n in nodes] + [controller.id])
    clash = [n.name for n in nodes if n.name in others]
    if clash:
        other = others[clash[0]]
        raise Conflict(f"nodes: {fold_hostlist(sorted(clash))} already belong to cluster {other!r}")
    if controller.name in others:
        raise Conflict(
            f"controller: {controller.name} already belongs to cluster {others[controller.name]!r}"
        )


def _set_members(session: Session, cluster: WlmCluster, controller: Node, nodes: list[Node]) -> None:
    """Make the cluster's rows name exactly ``nodes`` (compute) and its controller."""
    roles: dict[int, str] = {n.id or 0: WlmRole.COMPUTE.value for n in nodes}
    roles.setdefault(controller.id or 0, WlmRole.CONTROLLER.value)
    current = {
        m.node_id: m for m in session.exec(select(WlmMember).where(WlmMember.cluster_id == cluster.id))
    }
    gone = [node_id for node_id in current if node_id not in roles]
    for chunk in _chunks(gone):  # deleted first: a node may come back in another role
        session.execute(
            delete(WlmMember).where(
                col(WlmMember.cluster_id) == cluster.id, col(WlmMember.node_id).in_(chunk)
            )
        )
    for node_id, role in roles.items():
        row = current.get(node_id)
        if row is None:
            session.add(WlmMember(cluster_id=cluster.id or 0, node_id=node_id, role=role))
        elif row.role != role:
            row.role = role
            session.add(row)


def plan_deploy(session: Session, kind: str, req: WlmDeployRequest, actor: str) -> WlmCluster:
    """Create or update the cluster row and its members for a deploy; 404/409 before anything runs.

    Two deploys of one cluster exclude each other through the per-node locks the caller takes in the
    same transaction (a deploy of a crashed server expires with its locks instead of blocking forever).
    """
    wlm.get(kind)  # 422 for a kind bcm cannot drive, before anything is recorded
    names = expand_hostlist(req.nodes)
    nodes = node_svc.get_many(session, names)
    controller = node_svc.get_many(session, [req.controller])[0]
    _check_deployable(session, [controller], "controller")
    _check_deployable(session, nodes, "nodes")
    cluster = session.exec(select(WlmCluster).where(WlmCluster.name == req.name)).first()
    if cluster is not None and cluster.kind != kind:
        raise Conflict(f"name: cluster {req.name!r} is a {cluster.kind} cluster, not {kind}", field="name")
    _check_free(session, cluster, controller, nodes)
    if cluster is None:
        cluster = WlmCluster(name=req.name, kind=kind, controller_id=controller.id or 0)
    cluster.controller_id = controller.id or 0
    cluster.settings = req.settings_json()
    cluster.state = WlmState.DEPLOYING.value
    cluster.last_error = None
    cluster.updated_at = utcnow()
    session.add(cluster)
    session.flush()  # the cluster's id, for its member rows
    _set_members(session, cluster, controller, nodes)
    events.record(
        session,
        actor,
        "wlm.deploy",
        req.name,
        f"{kind} on {fold_hostlist(names)}, controller {controller.name}",
    )
    session.flush()
    return cluster


def _host(node: Node, addrs: dict[str, str | None], gpus: list[Gpu], cats: dict[Any, str]) -> wlm.WlmHost:
    return wlm.WlmHost(
        node.name,
        addrs[node.name],
        node.ssh_host_key,
        node.facts or {},
        [(g.index, g.name) for g in gpus],
        cats.get(node.category_id) if node.category_id is not None else None,
        {g.index: g.memory_mib for g in gpus if g.memory_mib},
    )


def build_plan(session: Session, state_dir: Path, name: str) -> wlm.DeployPlan:
    """What the workload manager renders from, read in one go; it renders, keeps its secrets in place
    and lists the Ansible hosts."""
    row = get(session, name)
    controller = session.get(Node, row.controller_id)
    if controller is None:
        raise NotFound(f"cluster {name}: controller node is gone")
    nodes = members(session, row)
    addrs = _addresses(session, [controller, *nodes])
    cats = {c.id: c.name for c in session.exec(select(Category))}
    gpus: dict[int, list[Gpu]] = {}
    for chunk in _chunks([m.id for m in nodes]):
        for g in session.exec(select(Gpu).where(col(Gpu.node_id).in_(chunk)).order_by(col(Gpu.index))):
            gpus.setdefault(g.node_id, []).append(g)
    spec = wlm.ClusterSpec(
        row.name,
        _host(controller, addrs, gpus.get(controller.id or 0, []), cats),
        [_host(m, addrs, gpus.get(m.id or 0, []), cats) for m in nodes],
        row.settings or {},
        tenancy.has_accounts(session),
    )
    plan = wlm.get(row.kind).plan(spec, secrets_dir(state_dir, name), render)
    row.munge_key_sha256 = plan.fingerprint
    session.add(row)
    return plan


def finish_deploy(
    session: Session, name: str, *, ok_nodes: list[str], failed: dict[str, str], error: str | None, actor: str
) -> WlmCluster:
    row = get(session, name)
    if error:
        row.state, row.last_error = WlmState.FAILED.value, error
    elif failed:
        row.state = WlmState.PARTIAL.value
        row.last_error = "; ".join(f"{n}: {e}" for n, e in list(failed.items())[:10])
    else:
        row.state, row.last_error, row.deployed_at = WlmState.DEPLOYED.value, None, utcnow()
    if not error:
        node_svc.join_workload_manager(session, ok_nodes)
    row.updated_at = utcnow()
    session.add(row)
    events.record(
        session,
        actor,
        "wlm.deployed" if row.state == WlmState.DEPLOYED else "wlm.deploy_failed",
        name,
        row.last_error or f"deployed on {fold_hostlist(ok_nodes)}",
        severity="info" if row.state == WlmState.DEPLOYED else "error",
    )
    session.flush()
    return row


def record_verify(session: Session, name: str, op_id: int, ok: bool, detail: dict[str, Any]) -> None:
    row = get(session, name)
    row.last_verify_op, row.last_verify_ok, row.last_verify_at = op_id, ok, utcnow()
    row.last_verify = detail
    session.add(row)
    session.flush()


def controller(session: Session, row: WlmCluster, state_dir: Path, port: int) -> wlm.Controller:
    """How drivers reach the cluster's controller: SSH, and the cluster's credentials directory."""
    name, addr, key = controller_target(session, row)
    return wlm.Controller(name, addr, port, key, secrets_dir(state_dir, row.name))


def controller_target(session: Session, row: WlmCluster) -> tuple[str, str, str | None]:
    """(name, address, pinned host key) of the cluster's controller."""
    node = session.get(Node, row.controller_id)
    if node is None:
        raise NotFound(f"cluster {row.name}: controller node is gone")
    addr = _addresses(session, [node])[node.name]
    if not addr:
        raise Conflict(f"cluster {row.name}: controller {node.name} has no IP address")
    return node.name, addr, node.ssh_host_key


def _live_members(session: Session, names: list[str]) -> list[tuple[str, str]]:
    """(node, cluster) for those of the named nodes that are compute members of a deployed cluster."""
    found: list[tuple[str, str]] = []
    for chunk in _chunks(names):
        stmt = (
            select(Node.name, WlmCluster.name)
            .join(WlmMember, col(WlmMember.node_id) == col(Node.id))
            .join(WlmCluster, col(WlmCluster.id) == col(WlmMember.cluster_id))
            .where(
                col(Node.name).in_(chunk),
                WlmMember.role == WlmRole.COMPUTE.value,
                col(WlmCluster.state).in_(_LIVE),
            )
        )
        found += list(session.exec(stmt))
    return found


def wlm_members(session: Session, names: list[str]) -> list[str]:
    """Those of the named nodes that belong to a deployed cluster (their drain goes through it)."""
    found = {node for node, _cluster in _live_members(session, names)}
    return [n for n in names if n in found]


def clusters_of(session: Session, names: list[str]) -> dict[str, list[str]]:
    """Deployed clusters holding the named nodes; 409 naming the nodes that belong to none."""
    owner = dict(_live_members(session, names))
    out: dict[str, list[str]] = {}
    for n in _in_order(owner):
        out.setdefault(owner[n], []).append(n)
    wanted = set(names) - set(owner)
    if wanted:
        raise Conflict(f"nodes: not in a deployed workload manager: {fold_hostlist(sorted(wanted))}")
    return dict(sorted(out.items()))


def apply_states(session: Session, name: str, states: dict[str, str]) -> int:
    """Store the workload manager's view of each member node (``None`` for nodes it does not know)."""
    row = get(session, name)
    changed = 0
    for node in members(session, row):
        new = states.get(node.name)
        new = new[:32] if new else new  # the column's bound (Node.wlm_state)
        if node.wlm_state != new:
            node.wlm_state = new
            session.add(node)
            changed += 1
    row.synced_at = utcnow()
    session.add(row)
    session.flush()
    return changed


def to_public(session: Session, row: WlmCluster, *, detail: bool = False) -> WlmClusterPublic:
    controller = session.get(Node, row.controller_id)
    nodes = members(session, row) if detail else []
    names = [m.name for m in nodes] if detail else member_names(session, row)
    base: dict[str, Any] = dict(
        name=row.name,
        kind=row.kind,
        controller=controller.name if controller else "?",
        nodes=fold_hostlist(names) if names else "",
        state=row.state,
        settings=row.settings or {},
        last_error=row.last_error,
        last_deploy_op=row.last_deploy_op,
        last_verify_op=row.last_verify_op,
        last_verify_ok=row.last_verify_ok,
        last_verify_at=row.last_verify_at,
        last_verify=row.last_verify,
        synced_at=row.synced_at,
        usage_at=row.usage_at,
        created_at=row.created_at,
        updated_at=row.updated_at,
        deployed_at=row.deployed_at,
    )
    if not detail:
        return WlmClusterPublic(**base)
    counts: dict[int, int] = {}
    for chunk in _chunks([m.id for m in nodes]):
        for g in session.exec(select(Gpu.node_id).where(col(Gpu.node_id).in_(chunk))):
            counts[g] = counts.get(g, 0) + 1
    return WlmClusterDetail(
        **base,
        members=[
            WlmNodePublic(
                name=m.name,
                wlm_state=m.wlm_state,
                provision_state=m.provision_state,
                gpus=counts.get(m.id or 0, 0),
            )
            for m in nodes
        ],
    )


# ---- zero-touch join ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class JoinPlan:
    """One cluster's zero-touch change: its members now, the booted nodes its categories add (or bring back
    after a reimage) and the retired members that leave."""

    cluster: str
    kind: str
    controller: str
    members: list[str]
    joining: list[str]
    settings: dict[str, Any]
    pending: list[str]  # nodes of those categories still provisioning or not yet inventoried
    missing: str | None = None  # why the cluster cannot change now (None: it can)
    leaving: tuple[str, ...] = ()

    def nodes(self) -> list[str]:
        """The cluster's compute nodes after the change."""
        return sorted({*self.members, *self.joining} - set(self.leaving))


def join_plans(session: Session, limit: int = 500) -> list[JoinPlan]:
    """For each cluster a category names (``wlm_cluster``): the booted, inventoried, unlocked nodes of those
    categories in no other cluster (a member back from a reimage is verified again), and its retired members."""
    cats = session.exec(
        select(Category.id, Category.wlm_cluster).where(col(Category.wlm_cluster).is_not(None))
    ).all()
    by_cluster: dict[str, list[int]] = {}
    for cid, cluster in cats:
        by_cluster.setdefault(str(cluster), []).append(cid or 0)
    plans = []
    for cluster, ids in sorted(by_cluster.items()):
        row = session.exec(select(WlmCluster).where(WlmCluster.name == cluster)).first()
        elsewhere = select(WlmMember.node_id)
        if row is not None:
            elsewhere = elsewhere.where(WlmMember.cluster_id != row.id)
        rows = session.exec(
            select(Node)
            .where(
                col(Node.category_id).in_(ids),
                col(Node.provision_state).in_([State.PROVISIONING.value, State.BOOTED.value]),
                col(Node.id).not_in(elsewhere),
            )
            .order_by(col(Node.name))
            .limit(limit)
        ).all()
        ready = [
            n.name
            for n in rows
            if n.provision_state == State.BOOTED.value
            and n.inventoried_at is not None
            and n.facts
            and not node_svc.is_locked(n)
        ]
        members = member_names(session, row) if row is not None else []
        leaving: tuple[str, ...] = ()
        if row is not None and members:
            gone = session.exec(
                select(Node.name)
                .join(WlmMember, col(WlmMember.node_id) == col(Node.id))
                .where(
                    WlmMember.cluster_id == row.id,
                    WlmMember.role == WlmRole.COMPUTE.value,
                    Node.provision_state == State.RETIRED.value,
                )
            ).all()
            leaving = tuple(sorted(gone))
        if not ready and not leaving:
            continue
        pending = [n.name for n in rows if n.name not in ready]
        if row is None:
            plans.append(JoinPlan(cluster, "", "", [], ready, {}, pending, f"no cluster named {cluster!r}"))
            continue
        ctl = session.get(Node, row.controller_id)
        why = None if row.state in _LIVE else f"cluster {cluster} is {row.state}"
        plans.append(
            JoinPlan(
                cluster,
                row.kind,
                ctl.name if ctl else "",
                members,
                ready,
                dict(row.settings or {}),
                pending,
                why,
                leaving,
            )
        )
    return plans


def fail_joining(session: Session, names: list[str], why: str, actor: str) -> None:
    """Zero-touch nodes that did not join: ``failed``, the reason (a job's output) in last_error."""
    for node in node_svc.get_many(session, names):
        if node.provision_state in (State.RETIRED.value, State.FAILED.value):
            continue
        node.provision_state = next_state(node.name, node.provision_state, Verb.FAIL).value
        node.last_error, node.updated_at = why[:4000], utcnow()
        session.add(node)
    events.record(session, actor, "node.join_failed", fold_hostlist(names), why[:500], severity="error")
    session.flush()
