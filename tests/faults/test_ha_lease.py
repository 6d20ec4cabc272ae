"""The leader lease and its fencing epoch, on a real database (SQLite and PostgreSQL): compare-and-set
under a row lock, takeover only after expiry with a higher epoch, and writes of an old epoch refused."""

from __future__ import annotations

import contextvars
import threading
from datetime import timedelta

import pytest
from sqlalchemy import text, update
from sqlalchemy.engine import Engine
from sqlmodel import col

from bcm.db import session_scope
from bcm.models.event import Event
from bcm.models.ha import LEASE_ROW, Leader
from bcm.workers import leader

LEASE_S = 30.0  # long: nothing here waits for it; expiry is written into the row


def _expire(engine: Engine) -> None:
    """The holder went silent: its lease ran out (as if ``lease_s`` had passed)."""
    with session_scope(engine) as s:
        past = leader.db_now(s) - timedelta(seconds=1)
        s.execute(update(Leader).where(col(Leader.id) == LEASE_ROW).values(expires_at=past))


def _events(engine: Engine, name: str) -> int:
    with session_scope(engine) as s:
        return int(s.execute(text("SELECT count(*) FROM event WHERE target = :t"), {"t": name}).scalar_one())


def _write_as(engine: Engine, holder: str, epoch: int, name: str) -> None:
    """A write of the leader's work: in the context that carries (holder, epoch)."""

    def write() -> None:
        with session_scope(engine) as s:
            s.add(Event(actor="bcm:test", action="ha.test", target=name, message="leader write"))

    ctx = contextvars.copy_context()
    ctx.run(leader._EPOCH.set, (holder, epoch))
    ctx.run(write)


def test_one_holder_takeover_after_expiry_with_a_higher_epoch(engine: Engine) -> None:
    a = leader.elect(engine, "a", "a:1", LEASE_S, leading=False)
    b = leader.elect(engine, "b", "b:1", LEASE_S, leading=False)
    assert a.epoch == 1 and a.holder == "a"
    assert b.epoch is None and b.holder == "a" and b.holder_epoch == 1  # a lease in force is not taken
    assert leader.elect(engine, "a", "a:1", LEASE_S, leading=True).epoch == 1  # renewal keeps the epoch

    _expire(engine)
    b = leader.elect(engine, "b", "b:1", LEASE_S, leading=False)
    assert b.epoch == 2 and b.holder == "b"
    a = leader.elect(engine, "a", "a:1", LEASE_S, leading=True)
    assert a.epoch is None and a.holder == "b"  # the old holder learns it lost, and takes nothing

    leader.resign(engine, "b")  # a clean stop frees the lease at once, the epoch stays
    assert leader.elect(engine, "a", "a:1", LEASE_S, leading=False).epoch == 3


def test_old_epoch_writes_are_refused_and_change_nothing(engine: Engine) -> None:
    assert leader.elect(engine, "a", "a:1", LEASE_S, leading=False).epoch == 1
    _write_as(engine, "a", 1, "while-leading")
    assert _events(engine, "while-leading") == 1

    _expire(engine)
    assert leader.elect(engine, "b", "b:1", LEASE_S, leading=False).epoch == 2
    refused_before = leader.refused_writes()
    with pytest.raises(leader.Fenced, match="epoch 1 is over"):
        _write_as(engine, "a", 1, "after-takeover")  # a paused old leader wakes up and writes
    assert _events(engine, "after-takeover") == 0
    assert leader.refused_writes() == refused_before + 1
    _write_as(engine, "b", 2, "new-leader")  # the new epoch writes
    assert _events(engine, "new-leader") == 1
    with session_scope(engine) as s:  # the explicit check, inside a write's own transaction
        with pytest.raises(leader.Fenced):
            leader.fence(s, "a", 1)
        leader.fence(s, "b", 2)

    # outside the leader's context nothing is checked: requests of every server write as always
    with session_scope(engine) as s:
        s.add(Event(actor="bcm:test", action="ha.test", target="request", message="any server"))
    assert _events(engine, "request") == 1


def test_concurrent_takeovers_make_exactly_one_leader_per_epoch(pg_engine: Engine) -> None:
    """PostgreSQL: 8 servers race for an expired lease, 5 times; each time exactly one wins."""
    leader.elect(pg_engine, "s0", "s0:1", LEASE_S, leading=False)
    for round_ in range(5):
        _expire(pg_engine)
        barrier = threading.Barrier(8, timeout=30)
        won: list[tuple[str, int]] = []
        lock = threading.Lock()

        def race(me: str) -> None:
            barrier.wait()
            lease = leader.elect(pg_engine, me, f"{me}:1", LEASE_S, leading=False)
            if lease.epoch is not None:
                with lock:
                    won.append((me, lease.epoch))

        # new names each round: the last round's winner would only extend its own lease (same epoch, rightly)
        threads = [threading.Thread(target=race, args=(f"r{round_}s{i}",)) for i in range(1, 9)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(won) == 1, won
        assert won[0][1] == round_ + 2  # one more than the last epoch, never skipped or repeated


@pytest.fixture
def pg_engine(pg_url: str) -> Engine:  # type: ignore[misc]
    from bcm.db import make_engine, upgrade

    eng = make_engine(pg_url)
    upgrade(eng)
    yield eng
    eng.dispose()
