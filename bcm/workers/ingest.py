"""Health reports written in batches: many agents' reports per transaction, each answered once it is stored.

A request parses and validates its report (a 422 needs no database), then hands it to
:class:`IngestQueue` and waits. One flusher takes whatever has gathered (up to ``batch`` reports) and,
in one worker thread and one transaction, checks every token of the batch in one query, judges every
report and writes them all (:func:`bcm.services.health.ingest_many`), commits, and answers each waiting
request with its own result or its own error (a foreign host, a revoked token). While one batch is being
written the next one gathers, so the batch grows with the load and no report waits for a timer.

The guarantee: a 202 is sent only after the transaction holding that report has committed — on
PostgreSQL with ``synchronous_commit`` as the server has it (on by default: flushed to the WAL), on
SQLite in WAL mode. A report that cannot be stored is never acknowledged: the agent gets the error (503
with Retry-After when the database is away), keeps the report and sends a newer one next interval.

Back-pressure: at most ``queue`` reports wait; beyond that a report is refused at once with 503 and
Retry-After, never dropped silently. A batch that fails on a constraint (a node deleted while its report
waited) is written again report by report, so one bad report does not sink the others.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import timedelta

import anyio
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine

from bcm import db_errors
from bcm.db import session_scope
from bcm.domain.health_report import HealthReport
from bcm.errors import BcmError, Unavailable
from bcm.models.auth import ApiToken
from bcm.models.base import utcnow
from bcm.services import auth
from bcm.services import health as svc
from bcm.settings import Settings

log = logging.getLogger("bcm.health")

# Writing last_used_at on every report would double the writes of the busiest endpoint.
TOKEN_TOUCH_EVERY = timedelta(minutes=5)
RETRY_AFTER_S = 1


@dataclass
class _Item:
    token: str
    report: HealthReport | BcmError  # a report that failed validation still needs its token checked first
    future: asyncio.Future[svc.IngestResult] = field(repr=False)


class IngestQueue:
    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine, self.settings = engine, settings
        self.capacity = settings.health.ingest_queue
        self.batch = settings.health.ingest_batch
        self._pending: list[_Item] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.batches = 0  # flushed batches, for /metrics and the bench
        self.reports = 0

    async def submit(self, token: str, report: HealthReport | BcmError) -> svc.IngestResult:
        """Store ``report`` as the node of ``token``; returns once it is committed, or raises its error."""
        if self._closed:
            raise Unavailable("the server is stopping; send the report again", retry_after=RETRY_AFTER_S)
        if len(self._pending) >= self.capacity:
            raise Unavailable(
                f"health ingest is behind ({len(self._pending)} reports waiting); send it again",
                retry_after=RETRY_AFTER_S,
            )
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._flush_forever(), name="bcm-health-ingest")
        future: asyncio.Future[svc.IngestResult] = asyncio.get_running_loop().create_future()
        self._pending.append(_Item(token, report, future))
        self._wake.set()
        return await future

    async def stop(self) -> None:
        """Refuse new reports, write the waiting ones, stop the flusher."""
        self._closed = True
        self._wake.set()
        if self._task is not None:
            await self._task

    async def _flush_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch, self._pending = self._pending[: self.batch], self._pending[self.batch :]
                await self._flush(batch)
            if self._closed:
                return

    async def _flush(self, batch: list[_Item]) -> None:
        try:
            results = await anyio.to_thread.run_sync(self._write, batch)
        except Exception as exc:  # the whole transaction failed: every report gets that answer
            err = db_errors.translate(exc)
            if err is None:
                log.exception("health ingest of %d reports failed", len(batch))
                err = Unavailable("health ingest failed; send the report again", retry_after=RETRY_AFTER_S)
            results = [err] * len(batch)
        self.batches += 1
        self.reports += len(batch)
        for item, result in zip(batch, results, strict=True):
            if item.future.done():  # the client went away
                continue
            if isinstance(result, BaseException):
                item.future.set_exception(result)
            else:
                item.future.set_result(result)

    def _write(self, batch: list[_Item]) -> list[svc.IngestResult | BcmError]:
        try:
            return self._write_once(batch)
        except sa_exc.IntegrityError:
            if len(batch) == 1:
                raise
            # e.g. a node deleted while its report waited: the others are stored, each on its own
            return [self._write_one(item) for item in batch]

    def _write_one(self, item: _Item) -> svc.IngestResult | BcmError:
        try:
            return self._write_once([item])[0]
        except Exception as exc:
            err = db_errors.translate(exc)
            if err is None:
                raise
            return err

    def _write_once(self, batch: list[_Item]) -> list[svc.IngestResult | BcmError]:
        with session_scope(self.engine) as session:
            tokens = auth.node_tokens(session, [i.token for i in batch], utcnow() - TOKEN_TOUCH_EVERY)
            results: list[svc.IngestResult | BcmError | None] = []
            work: list[tuple[int, HealthReport]] = []
            for item in batch:
                token = tokens[item.token]
                if isinstance(token, BcmError):
                    results.append(token)
                elif isinstance(item.report, BcmError):
                    results.append(item.report)
                else:
                    assert isinstance(token, ApiToken) and token.node_id is not None
                    results.append(None)
                    work.append((token.node_id, item.report))
            stored = iter(svc.ingest_many(session, work, self.settings.health))
            return [r if r is not None else next(stored) for r in results]
