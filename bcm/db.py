"""Engine and session factory: SQLite (WAL) by default, PostgreSQL by URL; schema by Alembic."""

from __future__ import annotations

import collections
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine
from sqlalchemy.pool import NullPool
from sqlmodel import Session, create_engine

from bcm.settings import DbSettings

log = logging.getLogger("bcm.db")
MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def make_engine(url: str, db: DbSettings | None = None, **kwargs: Any) -> Engine:
    """An engine for ``url`` whose pool never starves the worker threads and whose waits are bounded.

    SQLite gets WAL, foreign keys and a busy timeout on every connection, and a pool that grows as
    needed (a connection is a file handle). PostgreSQL gets a pool of one connection per worker thread
    plus as many again for the short commits that run outside them, a connect timeout, and statement,
    lock and idle-in-transaction timeouts on every session.
    """
    db = db or DbSettings()
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1].split("?", 1)[0]
        if "///" in url and path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            private_sqlite_files(Path(path))
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": db.busy_timeout_s},
            pool_size=db.threads,
            max_overflow=-1,
            pool_timeout=db.pool_timeout_s,
            **kwargs,
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        _queue_sqlite_writers(engine, db.busy_timeout_s)
        return engine
    engine = create_engine(
        url,
        pool_pre_ping=kwargs.pop("pool_pre_ping", True),
        pool_size=db.threads,
        max_overflow=db.threads,
        pool_timeout=db.pool_timeout_s,
        connect_args={"connect_timeout": db.connect_timeout_s},
        **kwargs,
    )
    timeouts = {
        "statement_timeout": db.statement_timeout_s,
        "lock_timeout": db.lock_timeout_s,
        "idle_in_transaction_session_timeout": db.statement_timeout_s * 2,
    }

    @event.listens_for(engine, "connect")
    def _pg_timeouts(dbapi_conn: Any, _record: Any) -> None:
        # SET here, not in the URL's options, which may already carry search_path
        cur = dbapi_conn.cursor()
        for name, seconds in timeouts.items():
            cur.execute(f"SET {name} = {int(seconds * 1000)}")
        cur.execute("SET TimeZone = 'UTC'")  # a naive timestamp bcm hands over (bcm.db_bulk) is UTC
        cur.close()
        dbapi_conn.commit()  # a rolled-back SET would not stick

    return engine


def private_sqlite_files(path: Path) -> None:
    """The database file 0600 like the other secrets (it holds token hashes and encrypted BMC passwords),
    created so before SQLite opens it; SQLite gives its -wal and -shm files the database file's mode."""
    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
    for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if file.exists() and file.stat().st_mode & 0o077:
            os.chmod(file, 0o600)


_WRITES = frozenset({"INSERT", "UPDATE", "DELETE", "REPLACE", "CREATE", "DROP", "ALTER", "BEGIN"})


class WriteTurn:
    """A lock handed to its waiters in arrival order (``threading.Lock`` is not fair: under load one
    waiter can lose every race for its whole timeout while others go ahead, #27)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._waiters: collections.deque[threading.Event] = collections.deque()
        self._held = False

    def acquire(self, timeout: float) -> bool:
        with self._mutex:
            if not self._held and not self._waiters:
                self._held = True
                return True
            turn = threading.Event()
            self._waiters.append(turn)
        if turn.wait(timeout):
            return True
        with self._mutex:
            if turn.is_set():  # handed over just as the wait ended
                return True
            self._waiters.remove(turn)
            return False

    def release(self) -> None:
        with self._mutex:
            if self._waiters:
                self._waiters.popleft().set()  # still held: now by the longest waiter
            else:
                self._held = False


def _queue_sqlite_writers(engine: Engine, timeout_s: float) -> None:
    """Writers take turns in this process, in arrival order, from their first write until commit.

    SQLite has one writer at a time anyway; its own busy handler polls with growing sleeps, so under
    load a waiting writer can lose every race for the whole busy timeout. A first-come-first-served
    lock held from the first write of a transaction until the connection returns to the pool serves
    writers in turn. A request gives it back before its answer is serialized
    (:func:`bcm.api.deps.commit_before_serialization`), so the turn is never held across a wait for
    another worker thread.
    """
    writer = WriteTurn()

    @event.listens_for(engine, "before_cursor_execute")
    def _take_turn(conn: Any, _cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if conn.info.get("writer") or statement.lstrip()[:7].split(" ")[0].upper() not in _WRITES:
            return
        if not writer.acquire(timeout=timeout_s):
            raise sa_exc.OperationalError(statement, params, sqlite3.OperationalError("database is locked"))
        conn.info["writer"] = True

    def _end_turn(_dbapi_conn: Any, record: Any, *_: Any) -> None:
        if record.info.pop("writer", None):
            writer.release()

    event.listen(engine, "checkin", _end_turn)
    event.listen(engine, "invalidate", _end_turn)


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(engine: Engine) -> None:
    """Bring the schema to the newest migration (idempotent), every step in one transaction.

    A crash half-way (kill -9, power loss) leaves the schema as it was before: the next start runs
    the same steps again. pysqlite would commit each DDL statement by itself, so on SQLite the
    transaction is driven here on a connection of its own.
    """
    url = engine.url.render_as_string(hide_password=False)
    cfg = alembic_config(url)
    migrator = _transactional_sqlite(url) if engine.dialect.name == "sqlite" else engine
    try:
        with migrator.begin() as conn:
            cfg.attributes["connection"] = conn
            current = MigrationContext.configure(conn).get_current_heads()
            script = ScriptDirectory.from_config(cfg)
            pending = [r.revision for r in script.iterate_revisions("heads", current or "base")]
            for revision in reversed(pending):
                log.info("schema: applying migration %s", revision)
                command.upgrade(cfg, revision)
    finally:
        if migrator is not engine:
            migrator.dispose()


def _transactional_sqlite(url: str) -> Engine:
    """A SQLite engine whose transactions include DDL (BEGIN issued here, not by pysqlite)."""
    engine = create_engine(url, poolclass=NullPool, connect_args={"check_same_thread": False, "timeout": 30})

    @event.listens_for(engine, "connect")
    def _no_implicit_transactions(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """One unit of work: commit on success, roll back on any error."""
    with Session(engine, expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
