"""The work engine: operations created, claimed under a lease, run, renewed, reclaimed and closed.

Every long verb is an Operation row run by a handler from one table (:mod:`bcm.workers.verbs`);
this module knows no verb. ``submit`` writes the row, takes its lease for this server
(:func:`bcm.workers.identity.server_id`) and locks its nodes for as long as the lease, in one
transaction, then runs the handler in a task bounded by the operation's timeout. Every
``lease_s / 3`` the runner renews the leases (and node locks) of the operations whose task is still
alive here — only those — and takes up open operations whose lease has lapsed, wherever they ran
(``FOR UPDATE SKIP LOCKED`` on PostgreSQL; SQLite has one server, which at start takes up whatever
was left open): a resumable handler runs again for the nodes that have no result yet (results
already stored stay), any other fails them with the reason. An operation ends succeeded, partial,
failed (an error, its timeout) or cancelled (``bcm op cancel``, from any server); a job that lost its
operation (cancelled, or taken by another server after its lease lapsed) writes nothing more. At
shutdown on PostgreSQL its operations are handed back (lease lapsed now) for another server, or the
restarted one, to take up; on SQLite they end then, unfinished nodes failed with the reason. Result writes that meet a database outage are retried with backoff for as long
as the lease lasts; past it, the reclaim cleans up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

import anyio
from sqlalchemy.engine import Engine

from bcm import db_errors
from bcm.db import session_scope
from bcm.domain.naming import expand_hostlist, fold_hostlist
from bcm.errors import BcmError, InvalidInput, Unavailable
from bcm.models.base import utcnow
from bcm.models.node import VerbResult
from bcm.models.operation import Operation
from bcm.services import nodes as node_svc
from bcm.services import operations as op_svc
from bcm.settings import Settings
from bcm.workers import identity, verbs
from bcm.workers.job import Handler, Job

log = logging.getLogger("bcm.workers")

SHUTDOWN_GRACE_S = 5.0
RETRY_FIRST_S = 0.25


class Runner:
    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        handlers: Mapping[str, Handler] | None = None,
        *,
        server: str | None = None,
        lease_s: float | None = None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.handlers = verbs.HANDLERS if handlers is None else handlers
        self.server = server or identity.server_id()
        self.lease_s = lease_s or settings.ops.lease_s  # BCM_OPS__LEASE_S
        self.clock = clock
        self.tasks: set[asyncio.Task[None]] = set()
        self.running: dict[int, asyncio.Task[None]] = {}
        self.held: dict[int, datetime] = {}  # op id -> when its lease lapses, as last renewed
        self._beat: asyncio.Task[None] | None = None
        self._stopping = False
        self.provisioner: Any = None  # bcm.workers.provision.Provisioner, set by the app

    # ---- the server's life --------------------------------------------------------------------

    async def start(self) -> None:
        """Size the worker threads to the pool; take up what dead servers left; renew from now on."""
        anyio.to_thread.current_default_thread_limiter().total_tokens = self.settings.db.threads
        await anyio.to_thread.run_sync(self._adopt_at_start)
        await self.tick()
        self._beat = asyncio.create_task(self._beat_forever(), name="bcm-op-leases")

    def _adopt_at_start(self) -> None:
        """One SQLite file has one server: whatever is open was left by a dead one. On PostgreSQL, only
        the operations of this host's dead processes are handed back at once; the others wait for
        their leases to lapse."""
        everything = self.engine.dialect.name == "sqlite"
        with session_scope(self.engine) as s:
            for op in op_svc.open_held(s):
                if op.owner and (everything or identity.dead_here(op.owner)):
                    op_svc.release(s, op, op.owner, self.clock())

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await self.tick()
            except Exception as exc:  # the database may be away for a while; the next beat retries
                log.warning("operation leases: %s", type(exc).__name__)

    async def tick(self) -> list[int]:
        """Renew the leases of live tasks (a task whose lease is gone is stopped); take up lapsed
        operations. Returns the operations taken up."""
        now = self.clock()
        until = now + timedelta(seconds=self.lease_s)
        alive = [i for i, t in self.running.items() if not t.done()]

        def renew() -> set[int]:
            with session_scope(self.engine) as s:
                return op_svc.renew(s, self.server, alive, until, now)

        renewed = await anyio.to_thread.run_sync(renew)
        for op_id in alive:
            if op_id in renewed:
                self.held[op_id] = until
            else:  # cancelled, ended, or lapsed and perhaps taken elsewhere: not ours to run any more
                log.warning("operation %s: lease lost; its task here stops", op_id)
                self.running[op_id].cancel()
        if self._stopping:
            return []
        taken = await anyio.to_thread.run_sync(self._reclaim, now, until)
        for job, handler, bound_s in taken:
            self._spawn(job, handler, bound_s, until)
        return [job.op_id for job, _, _ in taken]

    def _deadline(self, op: Operation, handler: Handler | None) -> datetime:
        bound = handler.timeout(self.settings, op.progress_total) if handler else 0.0
        return op.created_at + timedelta(seconds=bound)

    def _reclaim(self, now: datetime, until: datetime) -> list[tuple[Job, Handler, float]]:
        out: list[tuple[Job, Handler, float]] = []
        with session_scope(self.engine) as s:
            for op in op_svc.reclaimable(s, now):
                assert op.id is not None
                task = self.running.get(op.id)
                if task is not None and not task.done():
                    continue  # its task here is still stopping: the next beat
                was = op.owner or "a server that stopped"
                if not op_svc.take(s, op, self.server, until, now):
                    continue
                handler = self.handlers.get(op.kind)
                names = expand_hostlist(op.targets) if op.targets else []
                left = [n for n in names if n not in (op.results or {})]
                deadline = self._deadline(op, handler)
                why = None
                if handler is None:
                    why = f"interrupted: its server ({was}) went away and this server has no handler for {op.kind}"
                elif deadline <= now:
                    why = f"timed out: its server ({was}) went away and its time is up"
                elif not handler.resumable:
                    why = f"interrupted: its server ({was}) went away; {op.kind} is not resumed"
                if why is not None:
                    log.warning("operation %s %s %s", op.id, op.kind, why)
                    op_svc.add_results(s, op, {n: {"status": "interrupted", "message": why} for n in left})
                    if handler is not None and handler.on_error is not None:
                        handler.on_error(s, op, self.settings, why)
                    op_svc.finish(s, op, why)
                    continue
                assert handler is not None
                held = op_svc.relock(s, op, left, until, now)
                lost = {
                    n: {
                        "status": "locked",
                        "message": "another operation locked it while this one's server was away",
                    }
                    for n in left
                    if n not in held
                }
                line = f"taken up by {self.server} (claim {op.claims}) from {was}: {len(held)} of {len(names)} nodes to go\n"
                op_svc.add_results(s, op, lost, line)
                log.warning("operation %s %s %s", op.id, op.kind, line.strip())
                if names and not held:
                    op_svc.finish(s, op)
                    continue
                job = Job(
                    self.engine,
                    self.settings,
                    op.id,
                    held,
                    op.created_by or "bcm",
                    dict(op.spec or {}),
                    op.claims,
                )
                out.append((job, handler, (deadline - now).total_seconds()))
        return out

    async def shutdown(self) -> None:
        """Stop every job. On PostgreSQL its operation is handed back (lease lapsed now) for another
        server, or the restarted one, to take up; on SQLite, where no other server can, it ends now, its
        unfinished nodes failed with the reason."""
        self._stopping = True
        if self._beat is not None:
            self._beat.cancel()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=SHUTDOWN_GRACE_S)
        hand_back = self.engine.dialect.name != "sqlite"
        try:
            with session_scope(self.engine) as s:
                for op in op_svc.open_held(s, self.server):
                    if hand_back:
                        op_svc.release(s, op, self.server, self.clock())
                        log.info("operation %s %s handed back: this server stops", op.id, op.kind)
                    else:
                        self._end_stopped(s, op)
        except Exception as exc:  # the database may be gone too: the leases lapse by themselves
            log.warning("could not hand back operations at shutdown: %s", type(exc).__name__)

    def _end_stopped(self, s: Any, op: Operation) -> None:
        why = "interrupted: the server stopped while it ran"
        names = expand_hostlist(op.targets) if op.targets else []
        left = {n: {"status": "interrupted", "message": why} for n in names if n not in (op.results or {})}
        op_svc.add_results(s, op, left)
        handler = self.handlers.get(op.kind)
        if handler is not None and handler.on_error is not None:
            handler.on_error(s, op, self.settings, why)
        op_svc.finish(s, op, why)

    # ---- operations -----------------------------------------------------------------------------

    async def submit(
        self,
        kind: str,
        names: list[str],
        actor: str,
        reason: str | None = None,
        *,
        spec: dict[str, Any] | None = None,
        extra: Any = None,
    ) -> int:
        """Start an operation of ``kind`` on ``names``; its setup's refusal (404/409) comes back here."""
        handler = self.handlers.get(kind)
        if handler is None:
            raise InvalidInput(f"kind: no operation {kind!r}", field="kind")
        job, bound_s, until = await anyio.to_thread.run_sync(
            self._create, kind, handler, names, actor, reason, spec or {}, extra
        )
        self._spawn(job, handler, bound_s, until)
        return job.op_id

    async def verb(self, verb: str, names: list[str], actor: str, reason: str | None) -> VerbResult:
        """A node verb, as the verb table says it is done (an operation, a queue, or at once)."""
        return await verbs.node_verb(self, verb, names, actor, reason)

    def _create(
        self,
        kind: str,
        handler: Handler,
        names: list[str],
        actor: str,
        reason: str | None,
        spec: dict[str, Any],
        extra: Any,
    ) -> tuple[Job, float, datetime]:
        """The row, its lease and its node locks in one transaction (in a worker thread)."""
        with session_scope(self.engine) as s:
            op = op_svc.create(s, kind, fold_hostlist(names), len(names), actor, spec)
            op.log = f"{kind} {fold_hostlist(names)} by {actor}" + (f": {reason}" if reason else "") + "\n"
            assert op.id is not None
            if handler.setup is not None and (chosen := handler.setup(s, op, extra)) is not None:
                names = chosen
                op.targets, op.progress_total = fold_hostlist(names), len(names)
            s.add(op)
            now = self.clock()
            until = now + timedelta(seconds=self.lease_s)
            op_svc.take(s, op, self.server, until, now)
            owner = op_svc.lock_owner(op.id)
            # lock first, then check legality: nothing starts if any node may not take the verb
            node_svc.acquire_locks(s, names, owner, ttl_s=self.lease_s)
            if handler.moves_state:
                for node, target in node_svc.check_verb(s, names, kind, lock_owner=owner):
                    node.target_state = target.value
                    s.add(node)
            job = Job(self.engine, self.settings, op.id, names, actor, dict(op.spec or {}), op.claims)
            return job, handler.timeout(self.settings, len(names)), until

    def _spawn(self, job: Job, handler: Handler, bound_s: float, until: datetime) -> None:
        self.held[job.op_id] = until
        task = asyncio.ensure_future(self._run(job, handler, bound_s))
        self.tasks.add(task)
        self.running[job.op_id] = task

        def gone(t: asyncio.Task[None]) -> None:
            self.tasks.discard(t)
            if self.running.get(job.op_id) is t:
                self.running.pop(job.op_id, None)
                self.held.pop(job.op_id, None)

        task.add_done_callback(gone)

    async def _run(self, job: Job, handler: Handler, bound_s: float) -> None:
        op_svc.HOLDER.set(op_svc.Holder(self.server, job.claims))  # this task's writes are fenced by it
        try:
            async with asyncio.timeout(max(bound_s, 0.001)):
                await handler.run(job)
            await self._settle(job, self._finish_open, job.op_id)
        except TimeoutError:
            log.warning("operation %s timed out after %.0f s", job.op_id, bound_s)
            await self._settle(job, self._fail, job.op_id, f"timed out after {bound_s:.0f} s", handler)
        except asyncio.CancelledError:
            raise  # cancelled, lost, or this server stops: the row says what happens next, not this task
        except op_svc.LeaseLost:
            log.info("operation %s: ended or taken elsewhere; its task here stops", job.op_id)
        except Exception as exc:
            err = exc if isinstance(exc, BcmError) else db_errors.translate(exc)
            if isinstance(err, Unavailable) and handler.resumable:
                # the database went away under the job: hand it back, the next look resumes it
                log.warning("operation %s: database unavailable; handed back to resume", job.op_id)
                await self._settle(job, self._hand_back, job.op_id)
                return
            if err is None:  # a job bug must still close its operation
                log.exception("operation %s failed", job.op_id)
            message = err.message if err is not None else f"{type(exc).__name__}: {exc}"
            await self._settle(job, self._fail, job.op_id, message, handler)

    async def _settle(self, job: Job, fn: Callable[..., None], *args: Any) -> None:
        """Write an operation's end, retried with backoff while the database is away, for as long as
        this server's lease on it lasts; past it, the operation is another server's (or the next
        look's) to take up."""
        delay = RETRY_FIRST_S
        while True:
            try:
                await anyio.to_thread.run_sync(fn, *args)
                return
            except op_svc.LeaseLost:
                return
            except Exception as exc:
                if not isinstance(db_errors.translate(exc), Unavailable):
                    log.exception("operation %s: could not record its end", job.op_id)
                    return
                lapses = self.held.get(job.op_id)
                if lapses is None or self.clock() >= lapses:
                    log.warning("operation %s: database away past its lease; left to be taken up", job.op_id)
                    return
                log.warning("operation %s: database away (%s); retrying", job.op_id, type(exc).__name__)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.lease_s / 4)

    def _finish_open(self, op_id: int) -> None:
        with session_scope(self.engine) as s:
            op = op_svc.get(s, op_id)
            if not op_svc.is_finished(op):
                op_svc.finish(s, op)

    def _fail(self, op_id: int, error: str, handler: Handler) -> None:
        with session_scope(self.engine) as s:
            op = op_svc.get(s, op_id)
            if op_svc.is_finished(op):
                return
            op_svc.fence(s, op)
            if handler.on_error is not None:
                handler.on_error(s, op, self.settings, error)
            op_svc.finish(s, op, error)

    def _hand_back(self, op_id: int) -> None:
        with session_scope(self.engine) as s:
            op_svc.release(s, op_svc.get(s, op_id), self.server, self.clock())

    async def cancel(self, op_id: int, actor: str) -> None:
        """Stop an operation wherever it runs: it ends cancelled, its locks released; a task of it here
        stops now, one on another server at that server's next renewal."""

        def close() -> None:
            with session_scope(self.engine) as s:
                op = op_svc.cancel(s, op_id, actor)
                handler = self.handlers.get(op.kind)
                if handler is not None and handler.on_error is not None:
                    handler.on_error(s, op, self.settings, op.error or "cancelled")

        await anyio.to_thread.run_sync(close)
        task = self.running.get(op_id)
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=SHUTDOWN_GRACE_S)
