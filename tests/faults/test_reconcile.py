"""Operations under a lease, on SQLite and PostgreSQL: two Runner instances with server ids of their own
share one database and one clock that the test drives (no waiting on real time for a lease).

The nodes' SSH addresses are loopback listeners that accept connections and never answer
(``silent_ssh``), so an inventory is in flight for as long as its connect timeout says.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

from sqlmodel import select

from bcm.db import session_scope
from bcm.models.base import utcnow
from bcm.models.node import Node, NodeBulkCreate
from bcm.models.operation import Operation
from bcm.services import nodes
from bcm.services import operations as op_svc
from bcm.workers.runner import Runner
from tests.faults.test_operations import ADDRESSES, silent_ssh  # noqa: F401  (a fixture)

LEASE_S = 10.0


class Clock:
    """The runners' clock: real time plus whatever the test has moved it on."""

    def __init__(self) -> None:
        self.shift = timedelta()

    def __call__(self) -> datetime:
        return utcnow() + self.shift

    def advance(self, seconds: float) -> None:
        self.shift += timedelta(seconds=seconds)


def _nodes(engine: Any, hostlist: str, ip: str | None) -> None:
    with session_scope(engine) as s:
        nodes.bulk_create(s, NodeBulkCreate(nodes=hostlist, ip=ip), "test")


def _op(engine: Any, op_id: int) -> Operation:
    with session_scope(engine) as s:
        return op_svc.get(s, op_id)


def _locks(engine: Any) -> dict[str, str | None]:
    with session_scope(engine) as s:
        return {n.name: n.lock_owner for n in s.exec(select(Node))}


async def _until(what: str, check: Callable[[], Awaitable[Any] | Any], timeout_s: float = 60) -> Any:
    for _ in range(int(timeout_s / 0.1)):
        got = check()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _runners(settings: Any, engine: Any, port: int) -> tuple[Runner, Runner, Clock]:
    clock = Clock()
    slow = settings.model_copy(deep=True)
    slow.ssh.port, slow.ssh.connect_timeout_s = port, 300  # server a's inventory never ends by itself
    quick = settings.model_copy(deep=True)
    quick.ssh.port, quick.ssh.connect_timeout_s = port, 1  # server b's gives up on silent hosts at once
    a = Runner(engine, slow, server="server-a:1:aaaa", lease_s=LEASE_S, clock=clock)
    b = Runner(engine, quick, server="server-b:2:bbbb", lease_s=LEASE_S, clock=clock)
    # no SSH retries: each run's length is its connect timeout, which these tests set against the lease
    # (a run retried for longer than the lease would let b's lease lapse on the real-time clock)
    slow.ssh.retries = quick.ssh.retries = 0
    return a, b, clock


def test_a_lapsed_lease_is_taken_up_by_another_server_within_one_lease(
    engine: Any,
    settings: Any,
    silent_ssh: int,  # noqa: F811
) -> None:
    """Server a stops renewing (it died); within one lease of the lapse server b takes the inventory
    up, keeps the result a stored, runs the nodes without one, and ends it with every lock released."""
    _nodes(engine, "bare1", None)  # no address: its result is known at once
    _nodes(engine, "hang[1-2]", ADDRESSES[0])
    a, b, clock = _runners(settings, engine, silent_ssh)

    async def scenario() -> None:
        op_id = await a.submit("inventory", ["bare1", "hang1", "hang2"], "test")
        await _until("bare1's result", lambda: "bare1" in (_op(engine, op_id).results or {}))
        for task in list(a.tasks):  # server a dies: no write, no renewal from now on
            task.cancel()
        await asyncio.wait(a.tasks, timeout=10)
        clock.advance(LEASE_S / 2)
        assert await b.tick() == []  # a's lease still holds: nobody takes it
        assert _op(engine, op_id).owner == a.server
        clock.advance(LEASE_S / 2 + 0.001)  # lapsed just now
        assert await b.tick() == [op_id]
        taken = _op(engine, op_id)
        assert (taken.owner, taken.claims) == (b.server, 2)
        assert "taken up by server-b:2:bbbb (claim 2) from server-a:1:aaaa: 2 of 3 nodes to go" in taken.log
        await _until("b's run to end", lambda: not b.running)
        done = _op(engine, op_id)
        assert done.state == "failed" and done.owner is None and done.lease_expires is None, done
        assert {n: r["status"] for n, r in (done.results or {}).items()} == {
            "bare1": "no_address",  # a's, kept
            "hang1": "timed_out",  # b's
            "hang2": "timed_out",
        }
        assert done.progress_done == 3
        assert _locks(engine) == {"bare1": None, "hang1": None, "hang2": None}

    asyncio.run(scenario())


def test_a_paused_server_loses_its_operation_and_writes_nothing_more(
    engine: Any,
    settings: Any,
    silent_ssh: int,  # noqa: F811
) -> None:
    """Server a is frozen past its lease (its task alive, no renewal): b takes the operation; a's job
    then ends by itself and every write it tries is refused; a's next renewal stops its task. Never two
    runs at once."""
    _nodes(engine, "hang[1-2]", ADDRESSES[0])
    a, b, clock = _runners(settings, engine, silent_ssh)
    a.settings.ssh.connect_timeout_s = 2  # a's run ends by itself soon after b took over

    async def scenario() -> None:
        op_id = await a.submit("inventory", ["hang1", "hang2"], "test")
        a_task = a.running[op_id]
        # a's run has started (and stamped its lease) before the clock moves: a start after the move would
        # renew the lease on the moved clock, and b would rightly find nothing to take (seen once in CI)
        await _until("a's run to start", lambda: _op(engine, op_id).state == "running")
        b.settings.ssh.connect_timeout_s = 300  # b's run outlives a's
        clock.advance(LEASE_S + 0.001)
        assert await b.tick() == [op_id]
        await asyncio.wait({a_task}, timeout=30)  # a's inventory ended: its results were refused
        held = _op(engine, op_id)
        assert held.owner == b.server and held.state in ("pending", "running") and held.results == {}, held
        assert _locks(engine) == {"hang1": f"op-{op_id}", "hang2": f"op-{op_id}"}  # b's, not released
        assert await a.tick() == [] and op_id not in a.running  # a renews nothing: not its own
        assert _op(engine, op_id).owner == b.server
        await b.cancel(op_id, "test")
        assert _op(engine, op_id).state == "cancelled"

    asyncio.run(scenario())


def test_a_cancel_from_another_server_always_ends_cancelled(
    engine: Any,
    settings: Any,
    silent_ssh: int,  # noqa: F811
) -> None:
    """A cancel on server b of an operation running on server a: it ends cancelled, whatever a's job
    writes afterwards (its results and its finish are refused), locks released at once."""
    _nodes(engine, "hang[1-2]", ADDRESSES[0])
    a, b, _clock = _runners(settings, engine, silent_ssh)
    a.settings.ssh.connect_timeout_s = 1

    async def scenario() -> None:
        op_id = await a.submit("inventory", ["hang1", "hang2"], "test")
        task = a.running[op_id]  # taken now: a's job may notice the cancel and end before the next line
        await b.cancel(op_id, "operator")
        assert _locks(engine) == {"hang1": None, "hang2": None}
        await asyncio.wait({task}, timeout=30)  # a's job ran to its end without noticing
        op = _op(engine, op_id)
        assert op.state == "cancelled" and op.error == "cancelled by operator", op
        assert op.results == {} and op.owner is None, op

    asyncio.run(scenario())


def test_two_servers_never_take_the_same_operation(engine: Any, settings: Any) -> None:
    """Twenty operations left by a dead server, two servers looking at once: each is taken exactly once
    (PostgreSQL: FOR UPDATE SKIP LOCKED; SQLite: one writer) and each runs to its end."""
    _nodes(engine, "bare[1-20]", None)
    with session_scope(engine) as s:
        past = utcnow() - timedelta(seconds=1)
        for i in range(1, 21):
            op = op_svc.create(s, "inventory", f"bare{i}", 1, "test")
            op.owner, op.lease_expires, op.claims, op.state = "dead:9:dead", past, 1, "running"
            s.add(op)
    a = Runner(engine, settings, server="server-a:1:aaaa", lease_s=LEASE_S)
    b = Runner(engine, settings, server="server-b:2:bbbb", lease_s=LEASE_S)

    async def scenario() -> tuple[list[int], list[int]]:
        got_a, got_b = await asyncio.gather(a.tick(), b.tick())
        await _until("every run to end", lambda: not a.running and not b.running)
        return got_a, got_b

    got_a, got_b = asyncio.run(scenario())
    assert not set(got_a) & set(got_b) and len(got_a) + len(got_b) == 20, (got_a, got_b)
    with session_scope(engine) as s:
        ops = list(s.exec(select(Operation)))
    assert {(o.claims, o.state) for o in ops} == {(2, "failed")}, [(o.id, o.claims, o.state) for o in ops]
    assert all(o.results and next(iter(o.results.values()))["status"] == "no_address" for o in ops)
