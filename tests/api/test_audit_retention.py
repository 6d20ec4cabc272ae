"""The audit log stays bounded (#26): unauthenticated refusals are aggregated per client a minute, and a
supervised loop prunes events by age and count, noise first, never a person's action inside the retention.
Against real SQLite and PostgreSQL; clocks are driven, never waited on."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from bcm.models.base import utcnow
from bcm.models.event import Event
from bcm.services import events
from bcm.workers import audit


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(events, "time", c)
    monkeypatch.setattr(events, "_throttle", events._Throttle())
    return c


def add(engine: Engine, actor: str, n: int, age: timedelta = timedelta(0), action: str = "x") -> None:
    when = utcnow() - age
    with Session(engine) as s:
        s.add_all([Event(actor=actor, action=action, target=f"t{i}", time=when) for i in range(n)])
        s.commit()


def actors(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT actor, count(*) FROM event GROUP BY actor"))
        return {a: int(c) for a, c in rows}


def test_unauthenticated_refusals_are_one_event_a_minute_per_client_then_a_summary(
    engine: Engine, clock: Clock
) -> None:
    with Session(engine) as s:
        for _ in range(456):  # one client's burst
            events.record_unauthenticated(
                s, "boot", "boot.token.refused", "52:54:00:00:00:01", "refused", source="198.18.0.9"
            )
        events.record_unauthenticated(s, "boot", "boot.token.refused", "x", "refused", source="198.18.0.10")
        s.commit()
        assert len(list(s.exec(select(Event)))) == 2  # one per client
        assert events.flush_throttled(s) == 0  # the windows are still open
        clock.now += 61
        assert events.flush_throttled(s) == 1  # the other client was refused once: nothing to sum
        s.commit()
        summary = s.exec(select(Event).order_by(Event.id.desc())).first()  # type: ignore[union-attr]
        assert summary is not None and summary.detail == {"source": "198.18.0.9", "count": 455}
        assert "455 more" in summary.message
        assert events.flush_throttled(s) == 0  # written once


def test_pruning_by_age_takes_everything_past_the_retention(engine: Engine, settings: Any) -> None:
    settings.audit.retention_days = 30
    add(engine, "admin:root", 3, timedelta(days=31))
    add(engine, "bcm:boot", 5, timedelta(days=40))
    add(engine, "admin:root", 2, timedelta(days=29))
    add(engine, "bcm:boot", 4)
    result = audit.run_once(engine, settings)
    assert result.aged == 8 and result.over_count == 0
    assert actors(engine) == {"admin:root": 2, "bcm:boot": 4}


def test_over_the_count_noise_goes_first_and_peoples_actions_are_kept(
    engine: Engine, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    settings.audit.max_events = 100
    add(engine, "bcm:boot", 60, timedelta(days=2), action="boot.token.refused")  # old noise
    add(engine, "admin:root", 50, timedelta(days=1))
    add(engine, "operator:ops", 30, timedelta(days=1))
    add(engine, "node:gpu01", 20)
    add(engine, "bcm:boot", 10)  # recent noise
    with caplog.at_level(logging.WARNING, logger="bcm.audit"):
        result = audit.run_once(engine, settings)
    assert result.over_count == 70  # 170 - 100, all of it noise, the oldest first
    assert actors(engine) == {"admin:root": 50, "operator:ops": 30, "node:gpu01": 10, "bcm:boot": 10}
    # over the cap with people's actions only: they stay, and a warning says so
    add(engine, "admin:root", 40)
    with caplog.at_level(logging.WARNING, logger="bcm.audit"):
        result = audit.run_once(engine, settings)
    assert result.over_count == 20
    assert actors(engine) == {"admin:root": 90, "operator:ops": 30}
    assert any("people's actions inside the retention" in r.getMessage() for r in caplog.records)


def test_the_loop_logs_backs_off_retries_and_stops(
    engine: Engine, settings: Any, caplog: pytest.LogCaptureFixture, clock: Clock
) -> None:
    settings.audit.prune_interval_s = 10
    settings.audit.retention_days = 1
    delays: list[float] = []
    with engine.begin() as conn:  # the table is gone: every pass fails
        conn.execute(text("ALTER TABLE event RENAME TO event_away"))

    async def sleep(seconds: float) -> None:
        delays.append(seconds)
        if len(delays) == 3:  # the table is back: the next pass succeeds
            with engine.begin() as conn:
                conn.execute(text("ALTER TABLE event_away RENAME TO event"))
            add(engine, "bcm:boot", 3, timedelta(days=2))
        if len(delays) == 5:
            raise asyncio.CancelledError  # what the app's shutdown does to the task

    with caplog.at_level(logging.WARNING, logger="bcm.audit"), pytest.raises(asyncio.CancelledError):
        asyncio.run(audit.loop(engine, settings, sleep=sleep))
    assert delays == [20, 40, 80, 10, 10]  # doubled while failing, the interval again once it works
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "bcm.audit"]
    failures = [m for level, m in said if level == logging.ERROR]
    assert len(failures) == 1 and "audit pruning failed" in failures[0]  # once for the streak of three
    assert any("audit pruning works again after 3 failed passes" in m for _, m in said), said
    assert actors(engine) == {}  # the pass after the table came back pruned what was past the retention


def test_the_app_runs_the_pruning_loop_and_stops_it(settings: Any, engine: Engine) -> None:
    from fastapi.testclient import TestClient

    from bcm.api.app import create_app

    settings.audit.retention_days = 1
    add(engine, "bcm:boot", 5, timedelta(days=3))
    with TestClient(create_app(settings, engine)):
        for _ in range(200):  # bounded: the first pass runs at start-up
            if not actors(engine):
                break
            time.sleep(0.05)
    assert actors(engine) == {}
