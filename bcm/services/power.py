"""Power use cases: BMC passwords (encrypted, write-only), who to reach how, and what a result means.

Services flush but never commit; the BMCs themselves are reached only through bcm.drivers.power.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlmodel import Session, col, select

from bcm.domain.naming import fold_hostlist
from bcm.domain.power import (
    SHOULD_BE_ON,
    BmcProtocol,
    BmcTarget,
    PowerAction,
    PowerState,
    effective_bmc,
    parse_bmc_address,
)
from bcm.errors import BcmError
from bcm.models.base import utcnow
from bcm.models.category import Category
from bcm.models.node import Node
from bcm.services import categories as cat_svc
from bcm.services import events, secrets
from bcm.services import nodes as node_svc

CHUNK = 500


def set_node_password(session: Session, state_dir: Path, names: list[str], password: str, actor: str) -> int:
    """Store one BMC password (encrypted) on every named node; the event never carries it."""
    nodes = node_svc.get_many(session, names)
    for node in nodes:
        node.bmc_password_enc = secrets.encrypt(state_dir, password)
        node.updated_at = utcnow()
        session.add(node)
    events.record(session, actor, "node.bmc_password", fold_hostlist(names), "BMC password set")
    session.flush()
    return len(nodes)


def set_category_password(session: Session, state_dir: Path, name: str, password: str, actor: str) -> None:
    cat = cat_svc.get(session, name)
    cat.bmc_password_enc = secrets.encrypt(state_dir, password)
    session.add(cat)
    events.record(session, actor, "category.bmc_password", name, "BMC password set")
    session.flush()


@dataclass(frozen=True)
class Targets:
    reachable: list[BmcTarget]
    missing: dict[str, str]  # node -> why it has no usable BMC settings


def load_targets(session: Session, state_dir: Path, names: list[str]) -> Targets:
    """BMC targets of the named nodes (settings inherited from categories, passwords decrypted)."""
    reachable: list[BmcTarget] = []
    missing: dict[str, str] = {}
    cats: dict[int, dict[str, Any]] = {}
    for i in range(0, len(names), CHUNK):
        chunk = names[i : i + CHUNK]
        nodes = list(session.exec(select(Node).where(col(Node.name).in_(chunk))))
        need = {n.category_id for n in nodes if n.category_id is not None and n.category_id not in cats}
        if need:
            for c in session.exec(select(Category).where(col(Category.id).in_(need))):
                cats[c.id or 0] = {k: getattr(c, k) for k in ("bmc_protocol", "bmc_user", "bmc_password_enc")}
        for n in nodes:
            own = {k: getattr(n, k) for k in ("bmc_address", "bmc_protocol", "bmc_user", "bmc_password_enc")}
            values, why = effective_bmc(own, cats.get(n.category_id or -1))
            if why:
                missing[n.name] = why
                continue
            try:
                reachable.append(
                    BmcTarget(
                        node=n.name,
                        protocol=BmcProtocol(values["bmc_protocol"]),
                        address=parse_bmc_address(values["bmc_address"]),
                        user=values["bmc_user"],
                        password=secrets.decrypt(state_dir, values["bmc_password_enc"]),
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
    if state is PowerState.OFF and was != PowerState.OFF.value and node.provision_state in SHOULD_BE_ON:
        events.record(
            session,
            actor,
            "node.power_unexpected_off",
            node.name,
            f"node is {node.provision_state} but its BMC reports power off",
            severity="warning",
        )


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


def _chunks(items: list[str]) -> list[list[str]]:
    return [items[i : i + CHUNK] for i in range(0, len(items), CHUNK)]
