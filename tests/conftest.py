"""Shared fixtures: a database per test on SQLite or PostgreSQL, and an API client with an admin token."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

PG_URL = os.environ.get("BCM_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _pg_available() -> bool:
    try:
        eng = create_engine(PG_URL, connect_args={"connect_timeout": 3})
        with eng.connect() as conn:
            conn.execute(text("select 1"))
        eng.dispose()
        return True
    except Exception:
        return False


_PG = None


def pg_available() -> bool:
    global _PG
    if _PG is None:
        _PG = _pg_available()
    return _PG


@contextmanager
def pg_schema() -> Iterator[str]:
    """A URL for a fresh PostgreSQL schema of its own, dropped afterwards."""
    if not pg_available():
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is not reachable at {PG_URL}")
        pytest.skip(f"PostgreSQL is not reachable at {PG_URL}")
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    sep = "&" if "?" in PG_URL else "?"
    yield f"{PG_URL}{sep}options=-csearch_path%3D{schema}"
    with admin.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


@pytest.fixture(scope="session", autouse=True)
def lab_space_stays_local() -> None:
    """Tests use lab addresses (198.18.0.0/15) in fixtures and requests even without a lab: before any
    test runs, that range is unreachable from the host namespace, so nothing for it ever leaves the
    machine. Needs root; elsewhere a test that would connect to a lab address has no lab to reach."""
    if os.geteuid() != 0:
        return
    from bcm.lab.net import keep_lab_space_local

    keep_lab_space_local()


@pytest.fixture
def pg_url() -> Iterator[str]:
    with pg_schema() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database: a SQLite file, or a PostgreSQL schema of its own."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'bcm.db'}"
        return
    with pg_schema() as url:
        yield url


@pytest.fixture
def settings(tmp_path: Path, db_url: str):  # type: ignore[no-untyped-def]
    from bcm.settings import Settings

    # health reports in the server's thread, as on one core: the default on more cores starts writer
    # processes for each app, which doubles the time of every test that posts a report. Tests of the
    # writers set ingest_processes themselves; tests/unit/test_ingest_defaults.py checks the default.
    return Settings(state_dir=tmp_path / "state", database_url=db_url, health={"ingest_processes": 0})


@pytest.fixture
def engine(settings) -> Iterator[Engine]:  # type: ignore[no-untyped-def]
    from bcm.server import prepare

    eng, _ = prepare(settings)
    yield eng
    eng.dispose()


@pytest.fixture
def api(settings, engine):  # type: ignore[no-untyped-def]
    """A TestClient speaking HTTP to the app, authenticated as the bootstrap admin."""
    from fastapi.testclient import TestClient

    from bcm.api.app import create_app

    token = settings.admin_token_file.read_text().strip()
    with TestClient(create_app(settings, engine)) as client:
        client.headers["Authorization"] = f"Bearer {token}"
        yield client
