"""The health-ingest writer processes a head node gets when nobody sets ``health.ingest_processes``."""

from __future__ import annotations

import pytest

from bcm import settings as settings_mod
from bcm.settings import HealthSettings, Settings, default_ingest_processes

CASES = [
    # cores, sqlite, processes
    (1, False, 0),  # one core: the server's thread; a process would only take turns with the event loop
    (1, True, 0),
    (2, False, 2),  # the measured case: 2 processes beat the thread (1,254 against 827 reports/s) and 4
    (2, True, 2),
    (3, False, 3),
    (4, False, 4),
    (4, True, 2),  # one SQLite writer at a time: more processes only queue for the lock
    (64, False, 4),  # past 4 the database is the limit, not the writers
    (64, True, 2),
]


@pytest.mark.parametrize(("cores", "sqlite", "expected"), CASES)
def test_default_rule(cores: int, sqlite: bool, expected: int) -> None:
    assert default_ingest_processes(cores, sqlite=sqlite) == expected


def test_unset_follows_the_usable_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    health = HealthSettings()
    assert health.ingest_processes is None
    monkeypatch.setattr(settings_mod, "usable_cores", lambda: 8)
    assert health.writer_processes(sqlite=False) == 4
    assert health.writer_processes(sqlite=True) == 2
    monkeypatch.setattr(settings_mod, "usable_cores", lambda: 1)
    assert health.writer_processes(sqlite=False) == 0


@pytest.mark.parametrize("value", ["0", "3"])
def test_a_set_value_wins(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("BCM_HEALTH__INGEST_PROCESSES", value)
    monkeypatch.setattr(settings_mod, "usable_cores", lambda: 16)
    health = Settings().health
    assert health.writer_processes(sqlite=False) == int(value)
    assert health.writer_processes(sqlite=True) == int(value)


def test_usable_cores_is_the_affinity() -> None:
    import os

    assert settings_mod.usable_cores() == len(os.sched_getaffinity(0))


def test_the_queue_uses_the_rule(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import create_engine

    from bcm.workers.ingest import IngestQueue

    monkeypatch.setattr(settings_mod, "usable_cores", lambda: 8)
    settings = Settings(state_dir=tmp_path)
    sqlite = create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    pg = create_engine("postgresql+psycopg://bcm@127.0.0.1:1/bcm")  # never connected
    assert IngestQueue(sqlite, settings).processes == 2
    assert IngestQueue(pg, settings).processes == 4
    assert IngestQueue(pg, settings).in_flight == 5
