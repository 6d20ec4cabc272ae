"""Health reports written in batches: many agents' reports per transaction, each answered once it is stored.

A request hands its report to :class:`IngestQueue` and waits. A flusher takes whatever has gathered (up
to ``batch`` reports) and, in one writer and one transaction, checks every token of the batch in one
query, validates every report (a 422 for one that fails, after its token), judges every
report and writes them all (:func:`bcm.services.health.ingest_many`), commits, and answers each waiting
request with its own result or its own error (a foreign host, a revoked token). While one batch is being
written the next one gathers, so the batch grows with the load; with nothing being written a report
starts its batch at once. Where another batch may start while one is being written (writer processes),
it gathers for up to ``health.ingest_linger_ms`` first: each transaction costs the writer and the
database a fixed amount besides its rows (measured: about 5 ms of CPU), so fewer, bigger ones carry
more reports on the same cores.

The guarantee: a 202 is sent only after the transaction holding that report has committed — on
PostgreSQL with ``synchronous_commit`` as the server has it (on by default: flushed to the WAL), on
SQLite in WAL mode. A report that cannot be stored is never acknowledged: the agent gets the error (503
with Retry-After when the database is away), keeps the report and sends a newer one next interval.

Where the work runs (``health.ingest_processes``, unset: chosen from the cores by
:func:`bcm.settings.default_ingest_processes`): with 0, in a worker thread of the server; with N > 0,
in N processes of their own (each with its own database engine), so that parsing, judging and writing
reports use other cores than the one the server's event loop answers HTTP on: the request hands the raw
body over and the writer parses and validates it (in a thread the request parses it). Either way the
token is checked first, so a wrong token is a 401 even for a malformed report. Up to N + 1 batches are
written at once (N working, one waiting for the first free process); a node's report
never goes into a batch while another of its reports is being written, so each meets the state the one
before left. A writer process that dies fails its batch with a 503 and is replaced.

Back-pressure: at most ``queue`` reports wait; beyond that a report is refused at once with 503 and
Retry-After, never dropped silently. A batch that fails on a constraint (a node deleted while its report
waited) is written again report by report, so one bad report does not sink the others.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import signal
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import anyio
from pydantic import ValidationError
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine

from bcm import db_errors
from bcm.db import session_scope
from bcm.domain.health_report import HealthReport
from bcm.errors import BcmError, InvalidInput, Unavailable
from bcm.models.auth import ApiToken
from bcm.models.base import utcnow
from bcm.services import auth
from bcm.services import health as svc
from bcm.settings import Settings

log = logging.getLogger("bcm.health")

# Writing last_used_at on every report would double the writes of the busiest endpoint.
TOKEN_TOUCH_EVERY = timedelta(minutes=5)
RETRY_AFTER_S = 1

Report = bytes | HealthReport | BcmError  # raw body, already parsed, or the reason it cannot be
Answer = svc.IngestResult | BcmError


@dataclass
class _Item:
    token: str
    report: Report  # a report that failed validation still needs its token checked first
    future: asyncio.Future[svc.IngestResult] = field(repr=False)
    since: float  # the event loop's clock when it was taken


class IngestQueue:
    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine, self.settings = engine, settings
        self.capacity = settings.health.ingest_queue
        self.batch = settings.health.ingest_batch
        self.processes = settings.health.writer_processes(sqlite=engine.dialect.name == "sqlite")
        # batches being written at once: one per process and one more, waiting, so that a process that
        # finishes starts the next at once; in a thread one (the requests parse while it commits)
        self.in_flight = self.processes + 1 if self.processes else 1
        self.linger = settings.health.ingest_linger_ms / 1000
        self._timer: asyncio.TimerHandle | None = None
        self._pending: list[_Item] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._writing: set[asyncio.Task[None]] = set()
        self._busy_tokens: set[str] = set()  # tokens whose report a batch being written holds
        self._pool: ProcessPoolExecutor | None = None
        self._thread: anyio.CapacityLimiter | None = None
        self._closed = False
        self.batches = 0  # flushed batches, for /metrics and the bench
        self.reports = 0
        self.refused = 0  # reports refused with a 503 because ``capacity`` were already waiting

    @property
    def waiting(self) -> int:
        """Reports taken and not yet in a batch."""
        return len(self._pending)

    async def submit(self, token: str, report: Report) -> svc.IngestResult:
        """Store ``report`` as the node of ``token``; returns once it is committed, or raises its error."""
        if self._closed:
            raise Unavailable("the server is stopping; send the report again", retry_after=RETRY_AFTER_S)
        if len(self._pending) >= self.capacity:
            self.refused += 1
            raise Unavailable(
                f"health ingest is behind ({len(self._pending)} reports waiting); send it again",
                retry_after=RETRY_AFTER_S,
            )
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._flush_forever(), name="bcm-health-ingest")
        if isinstance(report, bytes) and not self.processes:
            report = parse_report(report)  # here, while the writer thread commits the batch before
        loop = asyncio.get_running_loop()
        future: asyncio.Future[svc.IngestResult] = loop.create_future()
        self._pending.append(_Item(token, report, future, loop.time()))
        self._wake.set()
        return await future

    async def stop(self) -> None:
        """Refuse new reports, write the waiting ones, stop the flusher and the writer processes."""
        self._closed = True
        self._wake.set()
        if self._task is not None:
            await self._task
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    async def _flush_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending and len(self._writing) < self.in_flight:
                if self._lingering():
                    break
                batch = self._take()
                if not batch:  # every waiting report is of a node whose report is being written
                    break
                task = asyncio.create_task(self._flush(batch), name="bcm-health-write")
                self._writing.add(task)
                task.add_done_callback(self._written)
            if self._closed and not self._pending and not self._writing:
                return

    def _lingering(self) -> bool:
        """While another batch is being written, let the next one gather for up to ``linger`` (and wake
        the flusher when that is up); with nothing being written it starts at once."""
        if not self._writing or self._closed or len(self._pending) >= self.batch:
            return False
        loop = asyncio.get_running_loop()
        left = self._pending[0].since + self.linger - loop.time()
        if left <= 0:
            return False
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_later(left, self._wake.set)
        return True

    def _take(self) -> list[_Item]:
        batch: list[_Item] = []
        rest: list[_Item] = []
        for item in self._pending:
            if len(batch) < self.batch and item.token not in self._busy_tokens:
                batch.append(item)
            else:
                rest.append(item)
        self._pending = rest
        self._busy_tokens.update(item.token for item in batch)
        return batch

    def _written(self, task: asyncio.Task[None]) -> None:
        self._writing.discard(task)
        self._wake.set()

    async def _flush(self, batch: list[_Item]) -> None:
        pairs = [(item.token, item.report) for item in batch]
        try:
            if self.processes > 0:
                results = await self._in_process(pairs)
            else:
                if self._thread is None:  # its own thread: never a request worker's (#27)
                    self._thread = anyio.CapacityLimiter(1)
                results = await anyio.to_thread.run_sync(
                    write_batch, self.engine, self.settings, pairs, limiter=self._thread
                )
        except Exception:  # write_batch answers every report itself; this is the hand-over failing
            log.exception("health ingest of %d reports could not be handed to a writer", len(batch))
            results = [
                Unavailable("health ingest failed; send the report again", retry_after=RETRY_AFTER_S)
            ] * len(batch)
        finally:
            self._busy_tokens.difference_update(item.token for item in batch)
        self.batches += 1
        self.reports += len(batch)
        for item, result in zip(batch, results, strict=True):
            if item.future.done():  # the client went away
                continue
            if isinstance(result, BaseException):
                item.future.set_exception(result)
            else:
                item.future.set_result(result)

    async def _in_process(self, pairs: list[tuple[str, Report]]) -> list[Answer]:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=self.processes,
                mp_context=multiprocessing.get_context("spawn"),  # no fork of a threaded server
                initializer=_writer_start,
                initargs=(self.settings, self.engine.url.render_as_string(hide_password=False), os.getpid()),
            )
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, _writer_batch, pairs)
        except BrokenProcessPool:
            log.error(
                "a health ingest process died; %d reports get a 503, a new process takes over", len(pairs)
            )
            self._pool.shutdown(wait=False)
            self._pool = None
            return [
                Unavailable("health ingest restarted; send the report again", retry_after=RETRY_AFTER_S)
            ] * len(pairs)


# --- the writer: the same code in a worker thread of the server or in a process of its own -----------


def write_batch(engine: Engine, settings: Settings, pairs: Sequence[tuple[str, Report]]) -> list[Answer]:
    """Parse, check, judge and store ``pairs`` (token, report) in one transaction; one answer each, and
    never an exception: a failed transaction gives every report its error (503 while the database is away)."""
    items = [(token, parse_report(r) if isinstance(r, bytes) else r) for token, r in pairs]
    try:
        try:
            return _write_once(engine, settings, items)
        except sa_exc.IntegrityError:
            if len(items) == 1:
                raise
            # e.g. a node deleted while its report waited: the others are stored, each on its own
            return [_write_one(engine, settings, item) for item in items]
    except Exception as exc:  # the whole transaction failed: every report gets that answer
        err = db_errors.translate(exc)
        if err is None:
            log.exception("health ingest of %d reports failed", len(items))
            err = Unavailable("health ingest failed; send the report again", retry_after=RETRY_AFTER_S)
        return [err] * len(items)


def parse_report(body: bytes) -> HealthReport | BcmError:
    try:
        return HealthReport.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid report"}
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        return InvalidInput(f"{where}: {first.get('msg', 'invalid')}", field=where)


def _write_one(engine: Engine, settings: Settings, item: tuple[str, HealthReport | BcmError]) -> Answer:
    try:
        return _write_once(engine, settings, [item])[0]
    except Exception as exc:
        err = db_errors.translate(exc)
        if err is None:
            raise
        return err


def _write_once(
    engine: Engine, settings: Settings, batch: list[tuple[str, HealthReport | BcmError]]
) -> list[Answer]:
    with session_scope(engine) as session:
        tokens = auth.node_tokens(session, [token for token, _ in batch], utcnow() - TOKEN_TOUCH_EVERY)
        results: list[Answer | None] = []
        work: list[tuple[int, HealthReport]] = []
        for secret, report in batch:
            token = tokens[secret]
            if isinstance(token, BcmError):
                results.append(token)
            elif isinstance(report, BcmError):
                results.append(report)
            else:
                assert isinstance(token, ApiToken) and token.node_id is not None
                results.append(None)
                work.append((token.node_id, report))
        stored = iter(svc.ingest_many(session, work, settings.health))
        return [r if r is not None else next(stored) for r in results]


_writer: dict[str, Any] = {}  # in a writer process: its settings and engine
PR_SET_PDEATHSIG = 1


def die_with(server_pid: int) -> None:
    """Have the kernel send SIGKILL to this process when the server dies, even by kill -9 (which runs no
    clean-up of the server's own): a writer left alive would hold its database sessions for ever (#27).

    Linux's prctl(PR_SET_PDEATHSIG); the executor starts its processes from the event loop's thread, which
    lives as long as the server. A server that died before this ran is noticed at once (another parent)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning(
                "health writer %d: prctl(PR_SET_PDEATHSIG) failed (errno %d)", os.getpid(), ctypes.get_errno()
            )
    except (OSError, AttributeError) as exc:  # not Linux
        log.warning("health writer %d cannot follow its server's death: %s", os.getpid(), exc)
    if os.getppid() != server_pid:
        os._exit(1)


def _writer_start(settings: Settings, url: str, server_pid: int | None = None) -> None:
    """A writer process starts: it dies with the server, takes the server's log level, and an engine on
    the server's own database."""
    if server_pid is not None:
        die_with(server_pid)
    from bcm import logs
    from bcm.db import make_engine

    logs.configure(settings.log_level, settings.log_format)
    _writer["settings"] = settings
    # no ping before each batch (a round trip per batch): a connection the database dropped costs the
    # batch on it a 503, which the agents send again, and the pool then drops every older connection
    _writer["engine"] = make_engine(url, settings.db, pool_pre_ping=False)
    from bcm.server import tune_gc

    tune_gc()  # as the server does: with the default thresholds collections cost more than the parsing


def _writer_batch(pairs: list[tuple[str, Report]]) -> list[Answer]:
    return write_batch(_writer["engine"], _writer["settings"], pairs)
