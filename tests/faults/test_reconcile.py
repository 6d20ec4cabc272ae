"""Which open operations a server interrupts: those of dead or silent servers, never a live one's."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from sqlmodel import select

from bcm.db import session_scope
from bcm.models.base import utcnow
from bcm.models.node import NodeBulkCreate
from bcm.models.operation import Operation
from bcm.services import nodes
from bcm.services import operations as op_svc
from bcm.workers import runner as runner_mod


def _open_op(engine: Any, runner: str, beat_ago_s: float, node: str) -> int:
    with session_scope(engine) as s:
        nodes.bulk_create(s, NodeBulkCreate(nodes=node), "test")
        op = op_svc.create(s, "inventory", node, 1, "test")
        op.runner, op.heartbeat_at, op.state = runner, utcnow() - timedelta(seconds=beat_ago_s), "running"
        op.results = {"done-before": {"status": "ok"}}
        s.add(op)
        s.flush()
        assert op.id is not None
        nodes.acquire_locks(s, [node], op_svc.lock_owner(op.id), ttl_s=3600)
        return op.id


def test_silent_servers_lose_their_operations_live_ones_keep_them(engine: Any, settings: Any) -> None:
    silent = _open_op(engine, "elsewhere:1:aaaa", runner_mod.SILENT_S + 30, "n1")
    alive = _open_op(engine, "elsewhere:2:bbbb", 1, "n2")
    r = runner_mod.Runner(engine, settings)
    r._reconcile(False)  # the periodic check every server runs
    with session_scope(engine) as s:
        ops = {o.id: o for o in s.exec(select(Operation))}
        states = {n.name: n.lock_owner for n in nodes.get_many(s, ["n1", "n2"])}
    assert ops[silent].state == "interrupted" and ops[silent].results == {"done-before": {"status": "ok"}}
    assert ops[alive].state == "running"
    assert states == {"n1": None, "n2": op_svc.lock_owner(alive)}


def test_at_start_sqlite_interrupts_every_open_operation(engine: Any, settings: Any) -> None:
    alive_looking = _open_op(engine, "elsewhere:2:bbbb", 1, "n3")
    r = runner_mod.Runner(engine, settings)

    async def start_and_stop() -> None:
        await r.start()
        await r.shutdown()

    asyncio.run(start_and_stop())
    with session_scope(engine) as s:
        op = op_svc.get(s, alive_looking)
        expected = "interrupted" if engine.dialect.name == "sqlite" else "running"  # PostgreSQL: shared
        assert op.state == expected
