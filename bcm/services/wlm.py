"""Workload-manager use cases on the database: plan a Slurm deploy, render its files, record outcomes,
map nodes to clusters, apply Slurm's node states. The SSH/Ansible work is in ``bcm.workers.wlm``.

Secrets live in 0600 files under ``<state_dir>/wlm/<cluster>/`` (directory 0700), not in the
database: an encryption key would have to sit in that same state directory, so encrypting would
protect nothing more, while files keep the secrets out of database dumps and API responses, and the
Ansible roles copy them with ``src:`` so they never become variables or log lines.

Services flush but never commit: the request or background job owns the transaction.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlmodel import Session, col, select

from bcm.domain.naming import expand_hostlist, fold_hostlist
from bcm.domain.slurm import NodeInput, SlurmCluster, SlurmSettings, build_cluster
from bcm.domain.states import State
from bcm.drivers.ansible import AnsibleHost
from bcm.errors import Conflict, NotFound
from bcm.models.base import utcnow
from bcm.models.category import Category
from bcm.models.gpu import Gpu
from bcm.models.node import Interface, Node
from bcm.models.wlm import (
    SlurmDeployRequest,
    WlmCluster,
    WlmClusterDetail,
    WlmClusterPublic,
    WlmKind,
    WlmNodePublic,
    WlmState,
)
from bcm.services import events
from bcm.services import nodes as node_svc
from bcm.services.render import render

SLURM_TEMPLATES = ("slurm.conf", "gres.conf", "cgroup.conf", "slurmdbd.conf")
MUNGE_KEY_BYTES = 1024  # what `mungekey` makes by default
_GONE = {State.RETIRED.value, State.DISCOVERED.value}


def render_slurm_files(cluster: SlurmCluster, storage_pass: str) -> dict[str, str]:
    """The four Slurm files for a cluster; only slurmdbd.conf sees the database password."""
    out = {}
    for name in SLURM_TEMPLATES:
        extra = {"storage_pass": storage_pass} if name == "slurmdbd.conf" else {}
        out[name] = render(f"slurm/etc/slurm/{name}.j2", cluster=cluster, s=cluster.settings, **extra)
    return out


# ---- secrets on disk ------------------------------------------------------------------------------


def secrets_dir(state_dir: Path, cluster: str) -> Path:
    return state_dir / "wlm" / cluster


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def ensure_munge_key(state_dir: Path, cluster: str) -> tuple[Path, str]:
    """The cluster's munge key file (made once, 0600) and its sha256; the key itself is never returned."""
    path = secrets_dir(state_dir, cluster) / "munge.key"
    if not path.exists():
        _write_private(path, secrets.token_bytes(MUNGE_KEY_BYTES))
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def store_storage_pass(state_dir: Path, cluster: str, password: str | None) -> None:
    if password is not None:
        _write_private(secrets_dir(state_dir, cluster) / "storage.pass", password.encode())


def storage_pass(state_dir: Path, cluster: str) -> str:
    path = secrets_dir(state_dir, cluster) / "storage.pass"
    return path.read_text() if path.exists() else ""


def write_slurmdbd_conf(state_dir: Path, cluster: str, text: str) -> Path:
    path = secrets_dir(state_dir, cluster) / "slurmdbd.conf"
    _write_private(path, text.encode())
    return path


def write_rendered(state_dir: Path, cluster: str, files: dict[str, str]) -> dict[str, str]:
    """Rendered files written out for Ansible to copy (``src:``): their text never passes through
    extra vars, where Ansible would template any ``{{ … }}`` in it on the head node."""
    out = {}
    for file_name, text in files.items():
        path = secrets_dir(state_dir, cluster) / "etc" / file_name
        _write_private(path, text.encode())
        out[file_name] = str(path)
    return out


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


def plan_slurm(session: Session, req: SlurmDeployRequest, actor: str) -> WlmCluster:
    """Create or update the cluster row for a deploy; 404/409 before anything runs.

    Two deploys of one cluster exclude each other through the per-node locks the caller takes in the
    same transaction (a deploy of a crashed server expires with its locks instead of blocking forever).
    """
    names = expand_hostlist(req.nodes)
    members = node_svc.get_many(session, names)
    controller = node_svc.get_many(session, [req.controller])[0]
    _check_deployable(session, [controller], "controller")
    _check_deployable(session, members, "nodes")
    for other in query(session):
        if other.name == req.name:
            continue
        clash = set(expand_hostlist(other.nodes)) & set(names)
        if clash:
            raise Conflict(f"nodes: {fold_hostlist(sorted(clash))} already belong to cluster {other.name!r}")
    cluster = session.exec(select(WlmCluster).where(WlmCluster.name == req.name)).first()
    if cluster is None:
        cluster = WlmCluster(
            name=req.name, kind=WlmKind.SLURM.value, controller_id=controller.id or 0, nodes=""
        )
    cluster.controller_id = controller.id or 0
    cluster.nodes = fold_hostlist(names)
    cluster.settings = req.settings.model_dump(mode="json")
    cluster.state = WlmState.DEPLOYING.value
    cluster.last_error = None
    cluster.updated_at = utcnow()
    session.add(cluster)
    events.record(
        session, actor, "wlm.deploy", req.name, f"slurm on {cluster.nodes}, controller {controller.name}"
    )
    session.flush()
    return cluster


@dataclass
class SlurmPlan:
    """Everything a deploy job needs, read from the database in one go."""

    cluster: str
    controller: str
    hosts: list[AnsibleHost]
    members: list[str]
    extravars: dict[str, Any]
    config: SlurmCluster


def build_plan(session: Session, state_dir: Path, name: str) -> SlurmPlan:
    """Render the files from the database, put the secrets in place, and list the Ansible hosts."""
    row = get(session, name)
    controller = session.get(Node, row.controller_id)
    if controller is None:
        raise NotFound(f"cluster {name}: controller node is gone")
    members = node_svc.get_many(session, expand_hostlist(row.nodes))
    addrs = _addresses(session, [controller, *members])
    cats = {c.id: c.name for c in session.exec(select(Category))}
    gpus: dict[int, list[tuple[int, str | None]]] = {}
    for g in session.exec(select(Gpu).where(col(Gpu.node_id).in_([m.id for m in members]))):
        gpus.setdefault(g.node_id, []).append((g.index, g.name))
    inputs = [
        NodeInput(
            m.name,
            addrs[m.name],
            m.facts or {},
            gpus.get(m.id or 0, []),
            cats.get(m.category_id) if m.category_id is not None else None,
        )
        for m in members
    ]
    settings = SlurmSettings.model_validate(row.settings or {})
    config = build_cluster(row.name, controller.name, addrs[controller.name], inputs, settings)
    files = render_slurm_files(config, storage_pass(state_dir, name))
    key_path, fingerprint = ensure_munge_key(state_dir, name)
    dbd_path = write_slurmdbd_conf(state_dir, name, files.pop("slurmdbd.conf"))
    file_paths = write_rendered(state_dir, name, files)
    row.munge_key_sha256 = fingerprint
    session.add(row)
    member_names = [m.name for m in members]
    hosts = [
        AnsibleHost(
            controller.name,
            addrs[controller.name] or "",
            controller.ssh_host_key or "",
            ("slurm_controller", "slurmdbd", *(("slurm_nodes",) if controller.name in member_names else ())),
        )
    ]
    hosts += [
        AnsibleHost(m.name, addrs[m.name] or "", m.ssh_host_key or "", ("slurm_nodes",))
        for m in members
        if m.name != controller.name
    ]
    extravars = {
        "bcm_slurm": {
            "cluster": row.name,
            "files": file_paths,
            "slurm_user": settings.slurm_user,
            "munge_key_src": str(key_path),
            "slurmdbd_conf_src": str(dbd_path),
        }
    }
    return SlurmPlan(row.name, controller.name, hosts, member_names, extravars, config)


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


def controller_target(session: Session, row: WlmCluster) -> tuple[str, str, str | None]:
    """(name, address, pinned host key) of the cluster's controller."""
    node = session.get(Node, row.controller_id)
    if node is None:
        raise NotFound(f"cluster {row.name}: controller node is gone")
    addr = _addresses(session, [node])[node.name]
    if not addr:
        raise Conflict(f"cluster {row.name}: controller {node.name} has no IP address")
    return node.name, addr, node.ssh_host_key


def wlm_members(session: Session, names: list[str]) -> list[str]:
    """Those of the named nodes that belong to a deployed cluster (their drain goes through Slurm)."""
    wanted, found = set(names), set()
    for row in query(session):
        if row.state in (WlmState.DEPLOYED, WlmState.PARTIAL):
            found |= wanted & set(expand_hostlist(row.nodes))
    return [n for n in names if n in found]


def clusters_of(session: Session, names: list[str]) -> dict[str, list[str]]:
    """Deployed clusters holding the named nodes; 409 naming the nodes that belong to none."""
    wanted = set(names)
    out: dict[str, list[str]] = {}
    for row in query(session):
        if row.state not in (WlmState.DEPLOYED, WlmState.PARTIAL):
            continue
        hit = [n for n in expand_hostlist(row.nodes) if n in wanted]
        if hit:
            out[row.name] = hit
            wanted -= set(hit)
    if wanted:
        raise Conflict(f"nodes: not in a deployed workload manager: {fold_hostlist(sorted(wanted))}")
    return out


def apply_states(session: Session, name: str, states: dict[str, str]) -> int:
    """Store Slurm's view of each member node (``None`` for nodes slurmctld does not know)."""
    row = get(session, name)
    members = expand_hostlist(row.nodes)
    changed = 0
    for node in node_svc.get_many(session, members):
        new = states.get(node.name)
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
    base: dict[str, Any] = dict(
        name=row.name,
        kind=row.kind,
        controller=controller.name if controller else "?",
        nodes=row.nodes,
        state=row.state,
        settings=row.settings or {},
        last_error=row.last_error,
        last_deploy_op=row.last_deploy_op,
        last_verify_op=row.last_verify_op,
        last_verify_ok=row.last_verify_ok,
        last_verify_at=row.last_verify_at,
        last_verify=row.last_verify,
        synced_at=row.synced_at,
        created_at=row.created_at,
        updated_at=row.updated_at,
        deployed_at=row.deployed_at,
    )
    if not detail:
        return WlmClusterPublic(**base)
    members = node_svc.get_many(session, expand_hostlist(row.nodes))
    counts: dict[int, int] = {}
    for g in session.exec(select(Gpu.node_id).where(col(Gpu.node_id).in_([m.id for m in members]))):
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
            for m in members
        ],
    )
