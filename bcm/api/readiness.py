"""``/readyz``'s view of the database: a probe of its own, never a request worker thread or the write turn.

One probe at a time (``SELECT 1`` on a fresh connection of its own, in a thread of its own), shared by
every caller that asks meanwhile, a success kept for ``FRESH_S``: a saturated request pool, a held
SQLite write turn or an exhausted connection pool never delays the answer, and a stopped database is
noticed by the next probe. A probe that does not answer within its bound is a 503 at once (it goes on
in its thread, and the next caller waits for it again).
"""

from __future__ import annotations

import asyncio
import logging

import anyio
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine
from sqlalchemy.pool import NullPool

from bcm import db_errors
from bcm.errors import Unavailable
from bcm.settings import DbSettings

log = logging.getLogger("bcm.api")
FRESH_S = 0.5


class Readiness:
    def __init__(self, engine: Engine, db: DbSettings) -> None:
        sqlite = engine.dialect.name == "sqlite"
        args: dict[str, object] = (
            {"check_same_thread": False, "timeout": db.busy_timeout_s}
            if sqlite
            else {"connect_timeout": db.connect_timeout_s}
        )
        self.engine = create_engine(engine.url, poolclass=NullPool, connect_args=args)
        self.timeout_s = db.connect_timeout_s + 2.0
        self._probe: asyncio.Task[Unavailable | None] | None = None
        self._limiter: anyio.CapacityLimiter | None = None
        self._last: Unavailable | None = None
        self._at: float | None = None

    async def check(self) -> Unavailable | None:
        """None when the database answers, else the 503 to send."""
        loop = asyncio.get_running_loop()
        if self._at is not None and self._last is None and loop.time() - self._at < FRESH_S:
            return None  # a success is kept a moment; a failure is asked again (the database may be back)
        if self._probe is None or self._probe.done():
            self._probe = loop.create_task(self._run(), name="bcm-readiness-probe")
        try:
            async with asyncio.timeout(self.timeout_s):
                return await asyncio.shield(self._probe)
        except TimeoutError:
            return db_errors.unavailable(f"the database did not answer within {self.timeout_s:g} s")

    async def close(self) -> None:
        if self._probe is not None and not self._probe.done():
            self._probe.cancel()
        self.engine.dispose()

    async def _run(self) -> Unavailable | None:
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)
        result = await anyio.to_thread.run_sync(self._select, limiter=self._limiter, abandon_on_cancel=True)
        self._last, self._at = result, asyncio.get_running_loop().time()
        return result

    def _select(self) -> Unavailable | None:
        try:
            with self.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as exc:
            err = db_errors.translate(exc)
            ready_err = err if isinstance(err, Unavailable) else db_errors.unavailable("database not ready")
            log.warning("not ready: %s (%s)", ready_err.message, type(exc).__name__)
            return ready_err
        return None
