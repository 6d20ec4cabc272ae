"""SSH inventory: run the fact script on many nodes at once and store what each one has.

The ``inventory`` operation (:mod:`bcm.workers.inventory`) runs the script and hands each host's
result here. One dead, hung or refusing host never fails the batch: each host gets its own result,
and the healthy ones are inventoried.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bcm.agent.facts import SECTION_PREFIX
from bcm.domain.facts import parse_fact_output
from bcm.domain.states import Verb, next_state
from bcm.drivers import ssh
from bcm.errors import Conflict, IllegalTransition, InvalidInput, NotFound
from bcm.models.base import utcnow
from bcm.models.gpu import Gpu
from bcm.models.node import Interface, Node
from bcm.services import events

log = logging.getLogger("bcm.inventory")


@dataclass(frozen=True)
class NodeTarget:
    name: str
    address: str
    pinned_key: str | None


def load_targets(engine: Engine, names: list[str]) -> tuple[list[NodeTarget], dict[str, str]]:
    """SSH targets for the named nodes (boot interface address), and nodes that have no address."""
    targets, missing = [], {}
    with Session(engine) as s:
        rows = s.exec(select(Node).where(col(Node.name).in_(names))).all()
        ifaces: dict[int, list[Interface]] = {}
        for i in s.exec(select(Interface).where(col(Interface.node_id).in_([n.id for n in rows]))):
            ifaces.setdefault(i.node_id, []).append(i)
        for n in rows:
            addrs = sorted(ifaces.get(n.id or 0, []), key=lambda i: (not i.boot, i.id or 0))
            ip = next((i.ip for i in addrs if i.ip), None)
            if ip is None:
                missing[n.name] = "no IP address registered (set one with `bcm node set` or PATCH interfaces)"
            else:
                targets.append(NodeTarget(n.name, ip, n.ssh_host_key))
    return targets, missing


def store_result(session: Session, result: ssh.HostResult, actor: str) -> dict[str, Any]:
    """Apply one host's result to its node; returns the per-node result recorded on the operation."""
    node = session.exec(select(Node).where(Node.name == result.name)).one()
    node.target_state = None
    node.updated_at = utcnow()
    entry: dict[str, Any] = {"status": result.status.value, "message": result.error or ""}
    # transient connect failures retried (bcm.domain.fanout): `bcm node inventory --wait` shows them
    if result.attempts > 1:
        entry["attempts"] = result.attempts
    if result.status == "host_key_changed":
        node.last_error = f"SSH host key changed; refused: {result.error}"
        events.record(
            session,
            actor,
            "node.host_key_changed",
            node.name,
            node.last_error,
            severity="error",
            detail={"seen": result.host_key},
        )
    elif result.status in ("unreachable", "timed_out"):
        node.last_error = f"inventory: {result.status}: {result.error}"
        node.provision_state = next_state(node.name, node.provision_state, Verb.LOST).value
    elif result.status != "ok":
        node.last_error = f"inventory: {result.status}: {result.error or result.stderr[-500:]}"
    else:
        try:
            facts = parse_fact_output(result.stdout)
        except Exception as exc:  # a parser bug on odd hardware must not lose the other nodes
            log.exception("could not parse facts of %s", node.name)
            node.last_error = f"inventory: could not parse facts: {type(exc).__name__}: {exc}"
            session.add(node)
            return {"status": "command_failed", "message": node.last_error}
        if node.ssh_host_key is None and result.host_key:
            node.ssh_host_key = result.host_key  # pinned on first contact
            events.record(session, actor, "node.host_key_pinned", node.name)
        _apply_facts(session, node, facts)
        entry["message"] = _summary(facts)
        entry["gpus"] = len(facts.gpus)
    session.add(node)
    return entry


def _apply_facts(session: Session, node: Node, facts: Any) -> None:
    node.facts = facts.model_dump(mode="json", exclude={"gpus"})
    node.inventoried_at = utcnow()
    node.last_error = None
    node.provision_state = next_state(node.name, node.provision_state, Verb.INVENTORY_DONE).value
    _replace_gpus(session, node, facts.gpus)


def store_agent_facts(session: Session, node_id: int, output: str) -> dict[str, Any]:
    """Facts a node's agent sent (the fact script's output, run on the node): stored as an SSH inventory's
    are, on that node only, without an SSH round (a node bcm booted pushes them at once)."""
    node = session.get(Node, node_id)
    if node is None:
        raise NotFound("the token's node is gone")
    if not output.startswith(SECTION_PREFIX + "bcm-facts "):
        raise InvalidInput(
            "output: not the fact script's output (it starts with '@@@ bcm-facts N')", field="output"
        )
    try:
        facts = parse_fact_output(output)
    except Exception as exc:  # a parser bug or a made-up body: a 422, nothing stored
        raise InvalidInput(
            f"output: not the fact script's output ({type(exc).__name__})", field="output"
        ) from None
    try:
        next_state(node.name, node.provision_state, Verb.INVENTORY_DONE)
    except IllegalTransition as exc:
        raise Conflict(f"node {node.name} is {node.provision_state}: its facts are not taken now") from exc
    _apply_facts(session, node, facts)
    session.add(node)
    events.record(
        session, f"node:{node.name}", "node.inventory", node.name, f"facts from its agent: {_summary(facts)}"
    )
    session.flush()
    return {"node": node.name, "state": node.provision_state, "gpus": len(facts.gpus)}


def _replace_gpus(session: Session, node: Node, gpus: list[Any]) -> None:
    uuids = [g.uuid for g in gpus]
    session.execute(delete(Gpu).where(col(Gpu.node_id) == node.id))
    if uuids:  # a GPU moved here from another node
        session.execute(delete(Gpu).where(col(Gpu.uuid).in_(uuids)))
    session.flush()
    for g in gpus:
        session.add(Gpu(node_id=node.id, **g.model_dump(include=set(Gpu.model_fields) - {"id", "node_id"})))  # type: ignore[arg-type]


def _summary(facts: Any) -> str:
    cpu = facts.cpu
    mem = f"{facts.memory_bytes / 2**30:.0f} GiB" if facts.memory_bytes else "? GiB"
    threads = cpu.threads if cpu else "?"
    gpu = f", {len(facts.gpus)}× {facts.gpus[0].name}" if facts.gpus else ""
    return f"{threads} threads, {mem}{gpu}"
