"""Database failures become the documented bcm errors, from real SQLite and PostgreSQL exceptions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError

from bcm import db_errors
from bcm.devserver import free_port
from bcm.errors import Conflict, Duplicate, InvalidInput, Stale, Unavailable

SCHEMA = [
    "CREATE TABLE parent (id INTEGER PRIMARY KEY, name VARCHAR(20) NOT NULL UNIQUE)",
    "CREATE TABLE child (id INTEGER PRIMARY KEY, parent_id INTEGER NOT NULL REFERENCES parent(id))",
]


def _raised(engine: Any, *statements: str) -> DBAPIError:
    with pytest.raises(DBAPIError) as caught, engine.begin() as conn:
        for s in statements:
            conn.execute(text(s))
    return caught.value


@pytest.fixture
def db(db_url: str) -> Any:
    from bcm.db import make_engine

    engine = make_engine(db_url)
    with engine.begin() as conn:
        for s in SCHEMA:
            conn.execute(text(s))
        conn.execute(text("INSERT INTO parent (id, name) VALUES (1, 'a')"))
    yield engine
    engine.dispose()


def test_integrity_errors_name_what_failed(db: Any) -> None:
    dup = db_errors.translate(_raised(db, "INSERT INTO parent (id, name) VALUES (2, 'a')"))
    assert isinstance(dup, Duplicate) and dup.field == "name" and dup.status_code == 409
    fk = db_errors.translate(_raised(db, "INSERT INTO child (id, parent_id) VALUES (1, 99)"))
    assert type(fk) is Conflict and "does not exist" in fk.message
    null = db_errors.translate(_raised(db, "INSERT INTO parent (id) VALUES (3)"))
    assert isinstance(null, InvalidInput) and null.field == "name" and null.status_code == 422


def test_unreachable_postgresql_is_503_with_retry_after() -> None:
    port = free_port()  # nothing listens there
    engine = create_engine(
        f"postgresql+psycopg://postgres@127.0.0.1:{port}/x", connect_args={"connect_timeout": 2}
    )
    with pytest.raises(DBAPIError) as caught, engine.connect():
        pass
    err = db_errors.translate(caught.value)
    assert isinstance(err, Unavailable) and err.status_code == 503 and err.retry_after >= 1


def test_a_locked_sqlite_database_is_503(tmp_path: Path) -> None:
    from bcm.db import make_engine

    url = f"sqlite:///{tmp_path / 'x.db'}"
    holder = make_engine(url)
    with holder.begin() as conn:
        conn.execute(text("CREATE TABLE t (x INTEGER)"))
    impatient = create_engine(url, connect_args={"timeout": 0.1})
    with holder.connect() as conn:
        conn.exec_driver_sql("BEGIN IMMEDIATE")  # holds the write lock
        err = db_errors.translate(_raised(impatient, "INSERT INTO t VALUES (1)"))
        conn.rollback()
    assert isinstance(err, Unavailable) and "busy" in err.message
    holder.dispose()
    impatient.dispose()


def test_a_postgresql_serialization_failure_is_409(pg_url: str) -> None:
    engine = create_engine(pg_url, isolation_level="SERIALIZABLE")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE s (id INTEGER PRIMARY KEY, v INTEGER)"))
        conn.execute(text("INSERT INTO s VALUES (1, 0)"))
    with engine.connect() as a, engine.connect() as b:
        a.execute(text("SELECT v FROM s WHERE id = 1"))
        b.execute(text("SELECT v FROM s WHERE id = 1"))
        a.execute(text("UPDATE s SET v = 1 WHERE id = 1"))
        a.commit()
        with pytest.raises(DBAPIError) as caught:
            b.execute(text("UPDATE s SET v = 2 WHERE id = 1"))
        b.rollback()
    err = db_errors.translate(caught.value)
    assert isinstance(err, Stale) and err.status_code == 409
    engine.dispose()
