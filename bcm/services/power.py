"""Power use cases: BMC passwords (encrypted, write-only), who to reach how, and what a result means.

A password is sent only to the BMC it was set for: setting one (admin) records each node's current
BMC target with it, and ``load_targets`` refuses, without contacting anything, a node whose BMC target
has changed since. Plain-http Redfish needs the category's ``bmc_allow_http`` (admin only).

Services flush but never commit; the BMCs themselves are reached only through bcm.drivers.power.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sqlmodel import Session, col, select

from bcm.domain.naming import fold_hostlist
from bcm.domain.power import (
    SHOULD_BE_ON,
    BmcProtocol,
    BmcTarget,
    PowerAction,
    PowerState,
    binding_refusal,
    effective_bmc,
    parse_bmc_address,
    plain_http_refusal,
    target_key,
)
from bcm.errors import BcmError
from bcm.models.base import utcnow
from bcm.models.category import Category
from bcm.models.node import Node
from bcm.services import categories as cat_svc
from bcm.services import events, secrets
from bcm.services import nodes as node_svc

CHUNK = 500
T = TypeVar("T")


def set_node_password(session: Session, state_dir: Path, names: list[str], password: str, actor: str) -> int:
    """Store one BMC password (encrypted) on every named node, bound to each node's BMC as it is now.

    A node whose BMC changed since its last password loses its TLS pin too (a new BMC, a new certificate).
    The event never carries the password.
    """
    nodes = node_svc.get_many(session, names)
    current = current_targets(session, nodes)
    for node in nodes:
        target = current[node.name]
        if node.bmc_password_target != target:
            node.bmc_tls_pin = None
        node.bmc_password_enc = secrets.encrypt(state_dir, password)
        node.bmc_password_target = target
        node.updated_at = utcnow()
        session.add(node)
    events.record(session, actor, "node.bmc_password", fold_hostlist(names), "BMC password set")
    session.flush()
    return len(nodes)


def set_category_password(
    session: Session,
    state_dir: Path,
    name: str,
    password: str,
    actor: str,
    *,
    discover_range: str | None = None,
) -> None:
    """Store the category's BMC password, bound to the BMCs its member nodes have now.

    A node that joins the category later, or whose BMC changes, does not get it until an admin sets it again;
    except a machine the category's discovery rule registers whose reported BMC lies in ``discover_range``
    (zero-touch): it is bound to that BMC then. The range is set (or cleared) only with the password.
    """
    cat = cat_svc.get(session, name)
    members = list(session.exec(select(Node).where(Node.category_id == cat.id)))
    current = current_targets(session, members)
    before = cat.bmc_password_targets or {}
    for node in members:  # those that use this password and have another BMC now: a new certificate to pin
        if node.bmc_password_enc is None and before.get(node.name) != current[node.name] and node.bmc_tls_pin:
            node.bmc_tls_pin = None
            session.add(node)
    cat.bmc_password_enc = secrets.encrypt(state_dir, password)
    cat.bmc_password_targets = {n: t for n, t in sorted(current.items()) if t is not None}
    cat.bmc_discover_range = discover_range
    session.add(cat)
    also = f", and BMCs discovered in {discover_range}" if discover_range else ""
    events.record(
        session,
        actor,
        "category.bmc_password",
        name,
        f"BMC password set for {len(cat.bmc_password_targets)} node(s){also}",
    )
    session.flush()


def set_category_http(session: Session, name: str, allow: bool, actor: str) -> None:
    """Allow (or forbid again) the category's nodes to reach Redfish BMCs over plain http."""
    cat = cat_svc.get(session, name)
    cat.bmc_allow_http = allow
    session.add(cat)
    events.record(
        session,
        actor,
        "category.bmc_allow_http",
        name,
        "plain-http BMCs " + ("allowed" if allow else "forbidden"),
    )
    session.flush()


def clear_tls_pins(session: Session, names: list[str], actor: str) -> int:
    """Forget the nodes' pinned BMC certificates: the next contact pins anew (a BMC's certificate was replaced)."""
    nodes = node_svc.get_many(session, names)
    for node in nodes:
        node.bmc_tls_pin = None
        session.add(node)
    events.record(session, actor, "node.bmc_tls_unpin", fold_hostlist(names), "BMC certificate pins cleared")
    session.flush()
    return len(nodes)


def current_targets(session: Session, nodes: list[Node]) -> dict[str, str | None]:
    """Each node's BMC target (``target_key``) from its settings now; None when it has no address or protocol."""
    ids = {n.category_id for n in nodes if n.category_id is not None}
    protocols: dict[int, str | None] = {}
    for chunk in _chunks(sorted(ids)):
        rows = session.exec(select(Category.id, Category.bmc_protocol).where(col(Category.id).in_(chunk)))
        for cid, protocol in rows:
            protocols[cid or 0] = protocol
    found: dict[str, str | None] = {}
    for n in nodes:
        protocol = n.bmc_protocol or protocols.get(n.category_id or -1)
        try:
            found[n.name] = (
                target_key(BmcProtocol(protocol), parse_bmc_address(n.bmc_address))
                if n.bmc_address and protocol
                else None
            )
        except (BcmError, ValueError):
            found[n.name] = None
    return found


@dataclass(frozen=True)
class Targets:
    reachable: list[BmcTarget]
    missing: dict[str, str]  # node -> why it has no usable BMC settings; nothing was contacted


_CATEGORY_FIELDS = (
    "name",
    "bmc_protocol",
    "bmc_user",
    "bmc_password_enc",
    "bmc_password_targets",
    "bmc_allow_http",
)


def load_targets(session: Session, state_dir: Path, names: list[str]) -> Targets:
    """BMC targets of the named nodes (settings inherited from categories, passwords decrypted).

    A node whose password was set for another BMC than the one it has now, or whose Redfish BMC is plain
    http without its category's permission, is missing: its password is not even decrypted.
    """
    reachable: list[BmcTarget] = []
    missing: dict[str, str] = {}
    cats: dict[int, dict[str, Any]] = {}
    for i in range(0, len(names), CHUNK):
        chunk = names[i : i + CHUNK]
        nodes = list(session.exec(select(Node).where(col(Node.name).in_(chunk))))
        need = {n.category_id for n in nodes if n.category_id is not None and n.category_id not in cats}
        if need:
            for c in session.exec(select(Category).where(col(Category.id).in_(need))):
                cats[c.id or 0] = {k: getattr(c, k) for k in _CATEGORY_FIELDS}
        for n in nodes:
            cat = cats.get(n.category_id or -1)
            own = {k: getattr(n, k) for k in ("bmc_address", "bmc_protocol", "bmc_user", "bmc_password_enc")}
            values, why = effective_bmc(own, cat)
            if why:
                missing[n.name] = why
                continue
            try:
                protocol = BmcProtocol(values["bmc_protocol"])
                address = parse_bmc_address(values["bmc_address"])
                current = target_key(protocol, address)
                if n.bmc_password_enc is not None:
                    bound, source = n.bmc_password_target, None
                else:  # effective_bmc found a password: the category's
                    bound = ((cat or {}).get("bmc_password_targets") or {}).get(n.name)
                    source = (cat or {}).get("name")
                why = binding_refusal(n.name, bound, current, source)
                if why is None and address.is_plain_http(protocol) and not (cat and cat["bmc_allow_http"]):
                    why = plain_http_refusal(n.name, current, cat["name"] if cat else None)
                if why:
                    missing[n.name] = why
                    continue
                reachable.append(
                    BmcTarget(
                        node=n.name,
                        protocol=protocol,
                        address=address,
                        user=values["bmc_user"],
                        password=secrets.decrypt(state_dir, values["bmc_password_enc"]),
                        tls_pin=n.bmc_tls_pin,
                    )
                )
            except BcmError as exc:  # one node's bad settings or undecryptable password stay its own
                missing[n.name] = exc.message
    return Targets(reachable, missing)


def record_results(
    session: Session, action: PowerAction, results: dict[str, dict[str, Any]], actor: str
) -> None:
    """Store what the BMCs said: power state read or implied, one event per node for each action."""
    now = utcnow()
    for name_chunk in _chunks(list(results)):
        for node in session.exec(select(Node).where(col(Node.name).in_(name_chunk))):
            result = results[node.name]
            pin = result.get("tls_pin")
            if pin and result["status"] == "ok" and node.bmc_tls_pin is None:
                node.bmc_tls_pin = pin  # first contact that worked: this certificate is the BMC's from now on
            if result["status"] == "tls_changed":
                events.record(
                    session, actor, "node.bmc_tls_changed", node.name, result["message"], severity="warning"
                )
            state = result.get("power")
            if state is not None:
                if action is PowerAction.STATUS:
                    note_power_state(session, node, PowerState(state), actor)
                else:  # what an operator asked for is not a surprise
                    node.power_state = state
                node.power_checked_at = now
            elif result["status"] != "ok" and action is PowerAction.STATUS:
                node.power_state = PowerState.UNKNOWN.value
            session.add(node)
            if action.changes_power:
                ok = result["status"] == "ok"
                events.record(
                    session,
                    actor,
                    f"node.power_{action.value.replace('-', '_')}",
                    node.name,
                    "ok" if ok else f"{result['status']}: {result.get('message', '')}",
                    severity="info" if ok else "error",
                )
    session.flush()


def note_power_state(session: Session, node: Node, state: PowerState, actor: str) -> None:
    """Set the node's power state; a node that should be running but went off raises an event."""
    was = node.power_state
    node.power_state = state.value
    if state is PowerState.OFF and _boot_died(node):
        from bcm.services import pxe

        pxe.fail(
            session,
            node,
            f"provisioning: the machine powered off before it called back (its BMC said off "
            f"at {utcnow():%H:%M:%S} UTC, {BOOT_GRACE_S:.0f}+ s after bcm powered it on): its boot failed; "
            "check its console",
        )
        return
    if state is PowerState.OFF and was != PowerState.OFF.value and node.provision_state in SHOULD_BE_ON:
        events.record(
            session,
            actor,
            "node.power_unexpected_off",
            node.name,
            f"node is {node.provision_state} but its BMC reports power off",
            severity="warning",
        )


BOOT_GRACE_S = 30.0  # after the provisioning power-on, a machine that reads off has stopped on its own


def _boot_died(node: Node) -> bool:
    """A provisioning node that bcm powered on (its power step over, the node unlocked) and that is off now:
    its boot stopped (a kernel panic with panic=-1, a broken image that powers off) and no callback will come."""
    from datetime import timedelta

    now = utcnow()
    started = node.provision_started_at
    locked = node_svc.is_locked(node)  # the provisioning power step still holds it
    return (
        node.provision_state == "provisioning"
        and started is not None
        and not locked
        and now - _aware(started) > timedelta(seconds=BOOT_GRACE_S)
    )


def _aware(t: Any) -> Any:
    from datetime import UTC

    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def pollable(session: Session, after: str, limit: int) -> list[str]:
    """Names of nodes with a BMC address, in name order after ``after`` (a page of the poll)."""
    stmt = (
        select(Node.name)
        .where(col(Node.bmc_address).is_not(None))
        .where(col(Node.name) > after)
        .order_by(col(Node.name))
        .limit(limit)
    )
    return list(session.exec(stmt))


def _chunks(items: list[T]) -> list[list[T]]:
    return [items[i : i + CHUNK] for i in range(0, len(items), CHUNK)]
