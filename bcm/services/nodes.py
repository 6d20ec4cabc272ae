"""Node use cases: register (one or a hostlist), query, update, remove, verbs, per-node locks.

Services flush but never commit: the request or background job owns the transaction.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import bindparam, func, insert, or_, update
from sqlalchemy.orm import defer
from sqlalchemy.orm.attributes import set_committed_value
from sqlmodel import Session, col, select

from bcm.domain.hostkey import fingerprint
from bcm.domain.inheritance import INHERITED_FIELDS, effective_settings
from bcm.domain.naming import expand_hostlist, fold_hostlist, ip_sequence, mac_sequence
from bcm.domain.states import PUBLIC_VERBS, State, Verb, next_state
from bcm.errors import Conflict, Duplicate, IllegalTransition, InvalidInput, LockHeld, NotFound
from bcm.models.base import utcnow
from bcm.models.category import Category
from bcm.models.gpu import Gpu
from bcm.models.node import Interface as Iface
from bcm.models.node import (
    InterfacePublic,
    InterfaceSpec,
    Node,
    NodeBulkCreate,
    NodeCreate,
    NodePublic,
    NodeUpdate,
)
from bcm.services import events, images, wlm_usage
from bcm.services import secrets as secret_svc

CHUNK = 500  # keeps IN (...) lists under every backend's bound-parameter limit
INSTALL_FIELDS = (
    "install_mode",
    "next_install_mode",
    "data_node",
    "wipe_confirmed",
    "install_state",
    "installed_image",
    "installed_at",
    "install_bytes",
    "booted_image",
    "booted_from",
)
SETTING_FIELDS = (
    "image",
    "kernel_args",
    "wlm_role",
    "boot_mode",
    "comment",
    "bmc_address",
    "bmc_protocol",
    "bmc_user",
)


def _chunks(items: Sequence[Any], size: int = CHUNK) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _category_id(session: Session, name: str | None) -> int | None:
    if name is None:
        return None
    cat = session.exec(select(Category).where(Category.name == name)).first()
    if cat is None:
        raise InvalidInput(
            f"category: unknown category {name!r} (create it with `bcm category add`)", field="category"
        )
    return cat.id


def _taken(session: Session, column: Any, values: list[str]) -> list[str]:
    found: list[str] = []
    for chunk in _chunks(values, 5000):
        found += [v for v in session.exec(select(column).where(column.in_(chunk)))]
    return found


def _check_unique(session: Session, names: list[str], ifaces: list[InterfaceSpec]) -> None:
    """Duplicates within the request or against stored nodes → Duplicate naming field and values."""
    checks: list[tuple[str, Any, list[str]]] = [
        ("name", Node.name, names),
        ("mac", Iface.mac, [i.mac for i in ifaces if i.mac]),
        ("ip", Iface.ip, [i.ip for i in ifaces if i.ip]),
    ]
    for field, column, values in checks:
        repeated = [v for v, n in Counter(values).items() if n > 1]
        if repeated:
            raise Duplicate(f"{field}: given more than once: {', '.join(repeated[:5])}", field=field)
        taken = _taken(session, column, values)
        if taken:
            more = f" (and {len(taken) - 5} more)" if len(taken) > 5 else ""
            raise Duplicate(f"{field}: already in use: {', '.join(sorted(taken)[:5])}{more}", field=field)


def create(session: Session, spec: NodeCreate, actor: str) -> Node:
    ifaces = spec.interface_specs()
    _check_unique(session, [spec.name], ifaces)
    images.check_reference(session, spec.image)
    node = Node(
        name=spec.name,
        category_id=_category_id(session, spec.category),
        provision_state=spec.state.value,
        ssh_host_key=spec.ssh_host_key,
        **{f: getattr(spec, f) for f in SETTING_FIELDS},
    )
    session.add(node)
    session.flush()
    assert node.id is not None
    session.add_all([Iface(node_id=node.id, **i.model_dump()) for i in ifaces])
    events.record(session, actor, "node.create", node.name)
    session.flush()
    return node


def bulk_create(session: Session, spec: NodeBulkCreate, actor: str) -> list[NodePublic]:
    """All nodes of a hostlist, MACs/IPs consecutive from the first given; all or nothing."""
    names = expand_hostlist(spec.nodes)
    macs = mac_sequence(spec.mac, len(names)) if spec.mac else [None] * len(names)
    ips = ip_sequence(spec.ip, len(names)) if spec.ip else [None] * len(names)
    ifaces = [InterfaceSpec.model_construct(mac=m, ip=i) for m, i in zip(macs, ips, strict=True) if m or i]
    _check_unique(session, names, ifaces)
    images.check_reference(session, spec.image)
    now = utcnow()
    settings = {f: getattr(spec, f) for f in SETTING_FIELDS}
    common = {
        "category_id": _category_id(session, spec.category),
        "provision_state": State.REGISTERED.value,
        "created_at": now,
        "updated_at": now,
        **settings,
    }
    # Core inserts on the session's connection: 10,000 ORM objects cost more than the database work
    conn = session.connection()
    ids: dict[str, int] = {}
    for chunk in _chunks(names, 2000):
        rows = conn.execute(
            insert(Node).returning(col(Node.id), col(Node.name)), [{"name": n, **common} for n in chunk]
        )
        ids.update({name: node_id for node_id, name in rows if node_id is not None})
    with_iface = bool(spec.mac or spec.ip)
    if with_iface:
        conn.execute(
            insert(Iface),
            [
                {"node_id": ids[n], "name": "eth0", "mac": m, "ip": i, "boot": True}
                for n, m, i in zip(names, macs, ips, strict=True)
            ],
        )
    events.record(session, actor, "node.create", fold_hostlist(names), f"{len(names)} nodes")
    session.flush()
    # the views are built from what was just written, without reading 10,000 rows back
    cat = session.get(Category, common["category_id"]) if common["category_id"] is not None else None
    eff = effective_settings(settings, cat.model_dump() if cat else None).values
    return [
        NodePublic(
            name=n,
            category=spec.category,
            provision_state=State.REGISTERED.value,
            target_state=None,
            last_error=None,
            wlm_state=None,
            interfaces=[InterfacePublic(name="eth0", mac=m, ip=i, boot=True)] if with_iface else [],
            effective=eff,
            created_at=now,
            updated_at=now,
            **settings,
        )
        for n, m, i in zip(names, macs, ips, strict=True)
    ]


def get(session: Session, name: str) -> Node:
    node = session.exec(select(Node).where(Node.name == name)).first()
    if node is None:
        raise NotFound(f"node {name!r} not found")
    return node


def get_many(session: Session, names: list[str]) -> list[Node]:
    """Nodes in the order named; NotFound lists every unknown name."""
    found: dict[str, Node] = {}
    for chunk in _chunks(names):
        found.update({n.name: n for n in session.exec(select(Node).where(col(Node.name).in_(chunk)))})
    missing = [n for n in names if n not in found]
    if missing:
        raise NotFound(f"unknown node(s): {fold_hostlist(missing)}")
    return [found[n] for n in names]


def query(
    session: Session,
    *,
    state: str | None = None,
    category: str | None = None,
    hostlist: str | None = None,
    limit: int = 100,
    offset: int = 0,
) -> tuple[list[Node], int]:
    # a page shows no facts or host keys: leave those (large) columns unloaded
    stmt = select(Node).options(defer(Node.facts), defer(Node.ssh_host_key))  # type: ignore[arg-type]
    if state:
        try:
            State(state)
        except ValueError:
            raise InvalidInput(f"state: unknown state {state!r}", field="state") from None
        stmt = stmt.where(Node.provision_state == state)
    if category:
        stmt = stmt.where(Node.category_id == _category_id(session, category))
    if hostlist:
        names = expand_hostlist(hostlist, "nodes")
        if len(names) > CHUNK:
            stmt = stmt.where(or_(*[col(Node.name).in_(c) for c in _chunks(names)]))
        else:
            stmt = stmt.where(col(Node.name).in_(names))
    total = session.exec(select(func.count()).select_from(stmt.subquery())).one()
    rows = session.exec(stmt.order_by(col(Node.name)).offset(offset).limit(limit))
    return list(rows), int(total)


def to_public(session: Session, nodes: Sequence[Node]) -> list[NodePublic]:
    """API views of nodes, with interfaces, GPU counts, tenants and effective settings (4 queries per page)."""
    ids = [n.id for n in nodes]
    ifaces: dict[int, list[Iface]] = {}
    gpus: dict[int, int] = {}
    for chunk in _chunks(ids):
        for i in session.exec(select(Iface).where(col(Iface.node_id).in_(chunk)).order_by(col(Iface.id))):
            ifaces.setdefault(i.node_id, []).append(i)
        stmt = select(Gpu.node_id, func.count()).where(col(Gpu.node_id).in_(chunk)).group_by(col(Gpu.node_id))
        gpus.update({nid: cnt for nid, cnt in session.exec(stmt)})
    cat_ids = {n.category_id for n in nodes if n.category_id is not None}
    cats = (
        {c.id: c for c in session.exec(select(Category).where(col(Category.id).in_(cat_ids)))}
        if cat_ids
        else {}
    )
    cat_settings = {cid: {f: getattr(c, f) for f in INHERITED_FIELDS} for cid, c in cats.items()}
    tenants = wlm_usage.node_tenants(session, ids)
    out = []
    for n in nodes:
        cat = cats.get(n.category_id) if n.category_id is not None else None
        eff = effective_settings(
            {f: getattr(n, f) for f in INHERITED_FIELDS}, cat_settings.get(n.category_id) if cat else None
        )
        out.append(
            NodePublic(
                name=n.name,
                category=cat.name if cat else None,
                provision_state=n.provision_state,
                target_state=n.target_state,
                last_error=n.last_error,
                wlm_state=n.wlm_state,
                interfaces=[
                    InterfacePublic(name=i.name, mac=i.mac, ip=i.ip, boot=i.boot)
                    for i in ifaces.get(n.id or 0, [])
                ],
                gpu_count=gpus.get(n.id or 0, 0),
                locked_by=n.lock_owner if is_locked(n) else None,
                effective=eff.values,
                created_at=n.created_at,
                updated_at=n.updated_at,
                inventoried_at=n.inventoried_at,
                power_state=n.power_state,
                running_image=n.running_image,
                tenants=tenants.get(n.id or 0, []),
                **{f: getattr(n, f) for f in INSTALL_FIELDS},
                **{f: getattr(n, f) for f in SETTING_FIELDS},
            )
        )
    return out


def update_node(session: Session, name: str, spec: NodeUpdate, actor: str) -> Node:
    node = get(session, name)
    _check_unlocked([node])
    changes = spec.model_dump(exclude_unset=True)
    if "image" in changes:
        images.check_reference(session, changes["image"])
    if "category" in changes:
        node.category_id = _category_id(session, changes.pop("category"))
    new_ifaces = changes.pop("interfaces", None)
    if new_ifaces is not None:
        specs = [InterfaceSpec(**i) for i in new_ifaces]
        old = list(session.exec(select(Iface).where(Iface.node_id == node.id)))
        before, after = sorted(i.ip or "" for i in old), sorted(s.ip or "" for s in specs)
        if node.ssh_host_key and before != after:
            # the pin stays with the node: whatever answers at the new address must present the same key
            events.record(
                session,
                actor,
                "node.address",
                node.name,
                f"{', '.join(filter(None, before)) or '-'} -> {', '.join(filter(None, after)) or '-'}; "
                f"pinned host key {fingerprint(node.ssh_host_key)} kept",
            )
        for i in old:
            session.delete(i)
        session.flush()
        _check_unique(session, [], specs)
        session.add_all([Iface(node_id=node.id, **s.model_dump()) for s in specs])  # type: ignore[arg-type]
    for field, value in changes.items():
        setattr(node, field, value)
    node.updated_at = utcnow()
    session.add(node)
    events.record(session, actor, "node.update", node.name, ", ".join(sorted(spec.model_fields_set)))
    session.flush()
    return node


def rekey(session: Session, name: str, key: str | None, actor: str) -> Node:
    """Replace or clear a node's pinned host key: the one way an admin changes a pin, always audited."""
    node = get(session, name)
    _check_unlocked([node])
    old = fingerprint(node.ssh_host_key) if node.ssh_host_key else "none"
    if key != node.ssh_host_key:
        node.host_key_enc = None  # a private key bcm made no longer matches the pin
    node.ssh_host_key = key
    node.updated_at = utcnow()
    session.add(node)
    new = fingerprint(key) if key else "none (the next contact pins the key it presents)"
    events.record(session, actor, "node.rekey", node.name, f"host key {old} -> {new}")
    session.flush()
    return node


def pin_host_key(session: Session, node: Node, key: str, actor: str, why: str) -> None:
    """Pin ``key`` (one checked OpenSSH line) for the node; a change is a ``node.rekey`` event naming both
    fingerprints."""
    if key == node.ssh_host_key:
        return
    old = fingerprint(node.ssh_host_key) if node.ssh_host_key else "none"
    node.ssh_host_key, node.host_key_enc = key, None
    node.updated_at = utcnow()
    session.add(node)
    events.record(session, actor, "node.rekey", node.name, f"host key {old} -> {fingerprint(key)}: {why}")


def make_host_key(session: Session, state_dir: Path, node: Node, actor: str, why: str) -> str:
    """A new SSH host key made by bcm for the node's overlay: the private part encrypted at rest, the public
    part pinned (``node.rekey`` with both fingerprints)."""
    import asyncssh  # heavy; only provisioning makes keys

    key = asyncssh.generate_private_key("ssh-ed25519")
    kind, blob = key.export_public_key("openssh").decode().split()[:2]
    pin_host_key(session, node, f"{kind} {blob}", actor, why)
    node.host_key_enc = secret_svc.encrypt(state_dir, key.export_private_key("openssh").decode())
    session.add(node)
    return f"{kind} {blob}"


def regenerate_host_keys(session: Session, nodes: Sequence[Node], state_dir: Path, actor: str) -> list[str]:
    """``provision --rekey`` (admin): bcm makes new host keys for the nodes whose category leaves the key to
    bcm (those with ``host_key_source node`` make a new one at every boot anyway); their names."""
    cats = dict(session.exec(select(Category.id, Category.host_key_source)).all())
    done = []
    for n in nodes:
        if (cats.get(n.category_id) if n.category_id else None) == "node":
            continue
        make_host_key(session, state_dir, n, actor, "regenerated at an admin's request (provision --rekey)")
        done.append(n.name)
    return done


def delete(session: Session, names: list[str], actor: str) -> list[str]:
    nodes = get_many(session, names)
    _check_unlocked(nodes)
    from bcm.models.wlm import WlmCluster  # a cluster's controller cannot go without the cluster

    ids = [n.id for n in nodes]
    held = [
        c
        for i in range(0, len(ids), 500)
        for c in session.exec(select(WlmCluster).where(col(WlmCluster.controller_id).in_(ids[i : i + 500])))
    ]
    if held:
        by_id = {n.id: n.name for n in nodes}
        which = ", ".join(f"{by_id[c.controller_id]} (cluster {c.name})" for c in held)
        raise Conflict(
            f"nodes: {which} controls a workload-manager cluster: `bcm wlm rm CLUSTER` first", field="nodes"
        )
    for n in nodes:
        session.delete(n)
    events.record(session, actor, "node.delete", fold_hostlist(names))
    session.flush()
    return names


def check_verb(
    session: Session, names: list[str], verb: str, *, lock_owner: str | None = None
) -> list[tuple[Node, State]]:
    """Each named node with the state ``verb`` leads to; 409 naming every node that may not take it."""
    try:
        action = Verb(verb)
    except ValueError:
        action = None
    if action is None or action not in PUBLIC_VERBS:
        raise InvalidInput(
            f"verb: unknown verb {verb!r} (one of {', '.join(sorted(PUBLIC_VERBS))})", field="verb"
        )
    nodes = get_many(session, names)
    _check_unlocked(nodes, lock_owner)
    problems, moves = [], []
    for n in nodes:
        try:
            moves.append((n, next_state(n.name, n.provision_state, action)))
        except IllegalTransition as exc:
            problems.append(exc.message)
    if problems:
        more = f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise IllegalTransition("; ".join(problems[:10]) + more)
    return moves


def apply_verb(
    session: Session, names: list[str], verb: str, actor: str, reason: str | None = None
) -> list[Node]:
    """Move every named node by ``verb``; if any may not, nothing moves (409 naming each)."""
    moves = check_verb(session, names, verb)
    action = Verb(verb)
    nodes = [n for n, _ in moves]
    _compare_and_set(session, moves, action)
    events.record(session, actor, f"node.{action.value}", fold_hostlist(names), reason or "")
    session.flush()
    return nodes


def _compare_and_set(session: Session, moves: list[tuple[Node, State]], action: Verb) -> None:
    """Write each move only where the node is still in the state it was checked in and unlocked.

    Another request may have moved a node between the check and this write; then nothing is written
    (the caller's transaction rolls back) and the 409 names the state the node is in now. Rows are
    written in id order, so two verbs over overlapping node sets cannot deadlock.
    """
    now = utcnow()
    clear_error = action in (Verb.RESUME, Verb.REGISTER)
    table = Node.__table__  # type: ignore[attr-defined]
    values: dict[str, Any] = {"provision_state": bindparam("new"), "target_state": None, "updated_at": now}
    if clear_error:
        values["last_error"] = None
    stmt = (
        table.update()
        .where(table.c.id == bindparam("node_id"))
        .where(table.c.provision_state == bindparam("old"))
        .where(or_(table.c.lock_owner.is_(None), table.c.lock_expires < now))
        .values(**values)
    )
    ordered = sorted(moves, key=lambda m: m[0].id or 0)
    params = [{"node_id": n.id, "old": n.provision_state, "new": new.value} for n, new in ordered]
    written = sum(
        session.connection().execute(stmt, chunk).rowcount  # type: ignore[attr-defined]
        for chunk in _chunks(params)
    )
    if written != len(params):
        raise _lost_race(session, ordered, action)
    for n, new in ordered:  # the rows are written: keep the loaded objects in step without a second UPDATE
        set_committed_value(n, "provision_state", new.value)
        set_committed_value(n, "target_state", None)
        set_committed_value(n, "updated_at", now)
        if clear_error:
            set_committed_value(n, "last_error", None)


def _lost_race(session: Session, checked: list[tuple[Node, State]], action: Verb) -> IllegalTransition:
    """The 409 for a verb that lost a race: each node that changed, with the state it is in now."""
    was = {n.id or 0: n.provision_state for n, _ in checked}
    now_state: dict[int, tuple[str, str, str | None]] = {}
    for chunk in _chunks(list(was)):
        stmt = select(Node.id, Node.name, Node.provision_state, Node.lock_owner).where(
            col(Node.id).in_(chunk)
        )
        now_state.update({i: (name, st, lock) for i, name, st, lock in session.execute(stmt)})
    changed = []
    for node_id, old in was.items():
        name, state, lock = now_state.get(node_id, ("?", "removed", None))
        if state != old:
            changed.append(f"node {name} is now {state} (was {old})")
        elif lock:
            changed.append(f"node {name} was locked meanwhile by {lock}")
    detail = "; ".join(changed[:10]) or "nodes changed meanwhile"
    return IllegalTransition(
        f"cannot {action.value}: {detail}; look again and resend the verb if still wanted"
    )


def join_workload_manager(session: Session, names: list[str]) -> None:
    """Nodes a workload manager accepted are in service (ready); drained ones stay drained."""
    for node in get_many(session, names):
        try:
            node.provision_state = next_state(node.name, node.provision_state, Verb.JOIN_DONE).value
        except IllegalTransition:
            continue  # failed/unreachable nodes keep telling their own story
        session.add(node)
    session.flush()


def is_locked(node: Node) -> bool:
    """An operation holds the node: its lock has an owner and has not lapsed."""
    if node.lock_owner is None:
        return False
    return node.lock_expires is None or node.lock_expires > utcnow()


def _check_unlocked(nodes: Sequence[Node], owner: str | None = None) -> None:
    held = [n for n in nodes if is_locked(n) and n.lock_owner != owner]
    if held:
        raise LockHeld(
            f"locked by a running operation: {', '.join(f'{n.name} ({n.lock_owner})' for n in held[:10])}"
        )


def acquire_locks(session: Session, names: list[str], owner: str, ttl_s: float = 3600) -> list[Node]:
    """Take the per-node lock for every named node in one statement; LockHeld if any is taken."""
    nodes = get_many(session, names)
    now = utcnow()
    ids = sorted(n.id for n in nodes if n.id is not None)
    claimed = 0
    for chunk in _chunks(ids):
        # row locks in id order first (PostgreSQL; a no-op on SQLite): two operations over
        # overlapping nodes then wait for each other instead of deadlocking
        session.execute(
            select(Node.id).where(col(Node.id).in_(chunk)).order_by(col(Node.id)).with_for_update()
        )
        result = session.execute(
            update(Node)
            .where(col(Node.id).in_(chunk))
            .where(or_(col(Node.lock_owner).is_(None), col(Node.lock_expires) < now))
            .values(lock_owner=owner, lock_expires=now + timedelta(seconds=ttl_s))
            .execution_options(synchronize_session=False)
        )
        claimed += result.rowcount  # type: ignore[attr-defined]
    if claimed != len(ids):
        raise LockHeld(f"some of {fold_hostlist(names)} are locked by another operation")
    for n in nodes:
        session.refresh(n)
    return nodes


def release_locks(session: Session, names: list[str], owner: str) -> None:
    for chunk in _chunks(names):
        session.execute(
            update(Node)
            .where(col(Node.name).in_(chunk))
            .where(col(Node.lock_owner) == owner)
            .values(lock_owner=None, lock_expires=None)
            .execution_options(synchronize_session=False)
        )


def hardware(session: Session, name: str) -> dict[str, Any]:
    """The stored hardware facts of a node and its GPU rows."""
    node = get(session, name)
    gpus = session.exec(select(Gpu).where(Gpu.node_id == node.id).order_by(col(Gpu.index)))
    return {
        "name": node.name,
        "inventoried_at": node.inventoried_at,
        "facts": node.facts or {},
        "gpus": [g.model_dump(exclude={"id", "node_id"}) for g in gpus],
    }


def count_by_state(session: Session) -> dict[str, int]:
    """How many nodes are in each provision state (every state named, 0 where none is): one GROUP BY."""
    counts = {state.value: 0 for state in State}
    rows = session.exec(select(Node.provision_state, func.count()).group_by(col(Node.provision_state))).all()
    for state, n in rows:
        counts[state] = int(n)
    return counts
