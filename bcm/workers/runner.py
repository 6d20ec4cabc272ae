"""Background operations: persisted Operation rows, run as asyncio tasks in the server process.

A verb that starts work (``inventory`` …) is registered here with a job function; plain verbs
are applied at once in one transaction. An operation's life: its row and its node locks (owned by
``op-<id>``, for as long as its own timeout) are written in one transaction; the job runs; it ends
finished, failed (an error or its timeout), cancelled (``bcm op cancel``) or interrupted (the server
stopped: SIGTERM, or a dead server found by the next start or by another server's heartbeat check),
and its locks are released in every case.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import anyio
from sqlalchemy.engine import Engine
from sqlmodel import Session

from bcm import db_errors
from bcm.db import session_scope
from bcm.domain.naming import fold_hostlist
from bcm.errors import BcmError
from bcm.models.base import utcnow
from bcm.models.node import VerbResult
from bcm.models.operation import Operation, OpState
from bcm.services import health as health_svc
from bcm.services import nodes as node_svc
from bcm.services import operations as op_svc
from bcm.settings import Settings

log = logging.getLogger("bcm.workers")

# job(runner, op_id, names, actor) -> None; it records results and finishes the operation itself
Job = Callable[["Runner", int, list[str], str], Awaitable[None]]
# setup(session, op) -> names to lock (None: the names given), in the transaction that creates the
# operation; raising there creates nothing (a 404/409 for the caller)
Setup = Callable[[Session, Operation], "list[str] | None"]
# on_error(session, message): in the transaction that fails the operation (an error or its timeout)
OnError = Callable[[Session, str], None]
JOBS: dict[str, Job] = {}
# how long a job may run for n nodes (its node locks last as long, plus a margin)
Timeout = Callable[[Settings, int], float]
TIMEOUTS: dict[str, Timeout] = {}
LOCK_MARGIN_S = 60.0
HEARTBEAT_S = 10.0
SILENT_S = 60.0  # an open operation whose server has not said it is alive for this long is interrupted
SHUTDOWN_GRACE_S = 5.0


def fan_out_timeout(settings: Settings, n: int) -> float:
    """SSH fan-out: every batch of ``concurrency`` hosts may take a connect and a command timeout."""
    batches = max(1, math.ceil(n / settings.ssh.concurrency))
    return batches * (settings.ssh.connect_timeout_s + settings.ssh.command_timeout_s) + 60.0


def job(verb: str, timeout: Timeout = fan_out_timeout) -> Callable[[Job], Job]:
    """Register the background job that a verb starts, and how long it may run."""

    def register(fn: Job) -> Job:
        JOBS[verb] = fn
        TIMEOUTS[verb] = timeout
        return fn

    return register


def _dead_here(runner: str | None) -> bool:
    """A runner of this host whose process is gone (or is this process's earlier life, same pid)."""
    host, _, rest = (runner or "").partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname()[:64] or not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return runner != op_svc.PROCESS_ID
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Runner:
    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self.tasks: set[asyncio.Task[None]] = set()
        self.running: dict[int, asyncio.Task[None]] = {}
        self._heartbeat: asyncio.Task[None] | None = None
        self.provisioner: Any = None  # bcm.workers.provision.Provisioner, set by the app

    async def start(self) -> None:
        """Size the worker threads to the pool; interrupt what dead servers left; start the heartbeat."""
        anyio.to_thread.current_default_thread_limiter().total_tokens = self.settings.db.threads
        await anyio.to_thread.run_sync(self._reconcile, True)
        self._heartbeat = asyncio.create_task(self._beat_forever(), name="bcm-op-heartbeat")

    def _reconcile(self, at_start: bool) -> list[int]:
        """Interrupt operations whose server is gone; returns this process's open operations."""
        # one SQLite file has one server: at start, whatever is open was left by a dead one
        everything = at_start and self.engine.dialect.name == "sqlite"
        silent_since = None if everything else utcnow() - timedelta(seconds=SILENT_S)
        with session_scope(self.engine) as s:
            mine = op_svc.heartbeat(s)
            candidates = op_svc.orphans(s, silent_since=None)
            for op in candidates:
                silent = op.heartbeat_at is None or silent_since is None or op.heartbeat_at < silent_since
                if everything or silent or _dead_here(op.runner):
                    why = f"interrupted: its server ({op.runner or 'unknown'}) stopped while it ran"
                    log.warning("operation %s %s %s", op.id, op.kind, why)
                    op_svc.close(s, op, OpState.INTERRUPTED, why)
        return mine

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                still_open = set(await anyio.to_thread.run_sync(self._reconcile, False))
            except Exception as exc:  # the database may be away for a while; the next beat retries
                log.warning("operation heartbeat failed: %s", type(exc).__name__)
                continue
            for op_id, task in list(self.running.items()):
                if op_id not in still_open:  # cancelled or interrupted elsewhere (another server)
                    task.cancel()

    async def verb(self, verb: str, names: list[str], actor: str, reason: str | None) -> VerbResult:
        if verb in ("provision", "reimage"):  # queued for the Provisioner (bcm.workers.provision)
            from bcm.workers.provision import provision_verb

            return await provision_verb(self, verb, names, actor, reason)
        if verb in JOBS:
            timeout_s = TIMEOUTS[verb](self.settings, len(names))
            op_id, names = await anyio.to_thread.run_sync(self._start_job, verb, names, actor, reason, timeout_s)
            self._spawn(op_id, self._run(JOBS[verb], op_id, names, actor, timeout_s))
            return VerbResult(
                verb=verb, nodes=[{"name": n, "status": "started"} for n in names], operation_id=op_id
            )
        if verb in ("drain", "resume"):
            await self._through_workload_manager(verb, names, actor, reason)
        moved = await anyio.to_thread.run_sync(self._apply, verb, names, actor, reason)
        return VerbResult(verb=verb, nodes=moved)

    async def operation(
        self,
        kind: str,
        names: list[str],
        actor: str,
        reason: str | None,
        fn: Job,
        timeout_s: float | None = None,
        *,
        setup: Setup | None = None,
        on_error: OnError | None = None,
    ) -> int:
        """Run ``fn`` as an operation that moves no lifecycle state (power, deploys …).

        One transaction creates the row, runs ``setup`` (which may name the nodes to lock) and locks
        the nodes for ``timeout_s`` plus a margin; then ``fn`` runs in a task bounded by ``timeout_s``.
        Whatever ends it (its own finish, an error, its timeout, a cancel, the server stopping), the
        operation is closed and the locks are released; ``on_error`` settles what the job leaves behind
        when it fails.
        """
        timeout_s = timeout_s or fan_out_timeout(self.settings, len(names))
        op_id, names = await anyio.to_thread.run_sync(
            self._start_job, kind, names, actor, reason, timeout_s, False, setup
        )
        self._spawn(op_id, self._run(fn, op_id, names, actor, timeout_s, on_error))
        return op_id

    def _spawn(self, op_id: int, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        self.running[op_id] = task
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(lambda _t: self.running.pop(op_id, None))

    async def cancel(self, op_id: int, actor: str) -> None:
        """Stop an operation: closed as cancelled, locks released; its task here (if any) is stopped."""

        def close() -> None:
            with session_scope(self.engine) as s:
                op_svc.cancel(s, op_id, actor)

        await anyio.to_thread.run_sync(close)
        task = self.running.get(op_id)
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=SHUTDOWN_GRACE_S)

    async def _through_workload_manager(
        self, verb: str, names: list[str], actor: str, reason: str | None
    ) -> None:
        """Nodes in a deployed cluster are drained/resumed in its workload manager first (with a reason
        marked as bcm's: ``bcm: …`` in Slurm).

        Legality is checked before the workload manager is touched; if it fails, bcm's own state is
        left as it was.
        """
        from bcm.services import wlm as wlm_svc
        from bcm.workers import wlm as wlm_worker

        def members() -> list[str]:
            with session_scope(self.engine) as s:
                node_svc.check_verb(s, names, verb)
                return wlm_svc.wlm_members(s, names)

        in_wlm = await anyio.to_thread.run_sync(members)
        if not in_wlm:
            return
        if verb == "drain":
            await wlm_worker.drain(self.engine, self.settings, in_wlm, reason or "drained by an admin", actor)
        else:
            await wlm_worker.resume(self.engine, self.settings, in_wlm, actor)

    def _apply(self, verb: str, names: list[str], actor: str, reason: str | None) -> list[dict[str, Any]]:
        with session_scope(self.engine) as s:
            nodes = node_svc.apply_verb(s, names, verb, actor, reason)
            if verb in ("drain", "resume") and actor != health_svc.ACTOR:
                # an admin's own drain or resume takes over from bcm's (it will not undo or redo it)
                health_svc.note_admin_verb(s, [n.id for n in nodes if n.id is not None], verb)
            return [{"name": n.name, "status": "ok", "state": n.provision_state} for n in nodes]

    def _start_job(
        self,
        verb: str,
        names: list[str],
        actor: str,
        reason: str | None,
        timeout_s: float,
        transition: bool = True,
        setup: Setup | None = None,
    ) -> tuple[int, list[str]]:
        """Record the operation and lock its nodes in one transaction (in a worker thread)."""
        with session_scope(self.engine) as s:
            op = op_svc.create(s, verb, fold_hostlist(names), len(names), actor)
            op.log = f"{verb} {fold_hostlist(names)} by {actor}" + (f": {reason}" if reason else "") + "\n"
            assert op.id is not None
            if setup is not None and (chosen := setup(s, op)) is not None:
                names = chosen
                op.targets, op.progress_total = fold_hostlist(names), len(names)
                s.add(op)
            owner = op_svc.lock_owner(op.id)
            # lock first, then check legality: nothing starts if any node may not take the verb
            node_svc.acquire_locks(s, names, owner, ttl_s=timeout_s + LOCK_MARGIN_S)
            moves = node_svc.check_verb(s, names, verb, lock_owner=owner) if transition else []
            for node, target in moves:
                node.target_state = target.value
                s.add(node)
            return op.id, names

    async def _run(
        self, fn: Job, op_id: int, names: list[str], actor: str, timeout_s: float, on_error: OnError | None = None
    ) -> None:
        owner = op_svc.lock_owner(op_id)
        cancelled = False
        try:
            async with asyncio.timeout(timeout_s):
                await fn(self, op_id, names, actor)
        except TimeoutError:
            log.warning("operation %s timed out after %.0f s", op_id, timeout_s)
            await anyio.to_thread.run_sync(self._fail, op_id, f"timed out after {timeout_s:.0f} s", on_error)
        except asyncio.CancelledError:
            # stopping (SIGTERM) or cancelled: close it here and now, without waiting for a thread
            cancelled = True
            self._close(op_id, names, "interrupted: the server stopped while it ran")
            raise
        except BcmError as exc:  # a job's own refusal: its message, no traceback
            await anyio.to_thread.run_sync(self._fail, op_id, exc.message, on_error)
        except Exception as exc:  # a job bug must still close its operation
            log.exception("operation %s failed", op_id)
            err = db_errors.translate(exc)
            message = err.message if err is not None else f"{type(exc).__name__}: {exc}"
            await anyio.to_thread.run_sync(self._fail, op_id, message, on_error)
        finally:
            if not cancelled:
                await anyio.to_thread.run_sync(self._release, names, owner)

    def _fail(self, op_id: int, error: str, on_error: OnError | None = None) -> None:
        with session_scope(self.engine) as s:
            op = op_svc.get(s, op_id)
            if not op_svc.is_finished(op):
                op_svc.finish(s, op, error)
            if on_error is not None:
                on_error(s, error)

    def _close(self, op_id: int, names: list[str], why: str) -> None:
        try:
            with session_scope(self.engine) as s:
                op = op_svc.get(s, op_id)
                if not op_svc.is_finished(op):  # a cancel has closed it already
                    op_svc.close(s, op, OpState.INTERRUPTED, why)
                node_svc.release_locks(s, names, op_svc.lock_owner(op_id))
        except Exception as exc:  # the database may be gone too; the next start interrupts it then
            log.warning("could not close operation %s: %s", op_id, type(exc).__name__)

    def _release(self, names: list[str], owner: str) -> None:
        try:
            with session_scope(self.engine) as s:
                node_svc.release_locks(s, names, owner)
        except Exception as exc:  # see _close; lock TTLs bound the damage
            log.warning("could not release the locks of %s: %s", owner, type(exc).__name__)

    async def shutdown(self) -> None:
        """Stop every job: each closes its operation as interrupted; whatever is still open is closed."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=SHUTDOWN_GRACE_S)
        try:
            with session_scope(self.engine) as s:  # jobs started outside the Runner's lifecycle too
                for op_id in op_svc.heartbeat(s):
                    op = op_svc.get(s, op_id)
                    op_svc.close(s, op, OpState.INTERRUPTED, "interrupted: the server stopped while it ran")
        except Exception as exc:
            log.warning("could not close open operations at shutdown: %s", type(exc).__name__)
