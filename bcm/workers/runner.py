"""Background operations: persisted Operation rows, run as asyncio tasks in the server process.

A verb that starts work (``inventory`` …) is registered here with a job function; plain verbs
are applied at once in one transaction.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from sqlalchemy.engine import Engine

from bcm.db import session_scope
from bcm.domain.naming import fold_hostlist
from bcm.models.node import VerbResult
from bcm.services import nodes as node_svc
from bcm.services import operations as op_svc
from bcm.settings import Settings

log = logging.getLogger("bcm.workers")

# job(runner, op_id, names, actor) -> None; it records results and finishes the operation itself
Job = Callable[["Runner", int, list[str], str], Awaitable[None]]
JOBS: dict[str, Job] = {}


def job(verb: str) -> Callable[[Job], Job]:
    """Register the background job that a verb starts."""

    def register(fn: Job) -> Job:
        JOBS[verb] = fn
        return fn

    return register


class Runner:
    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Size the worker threads to the database pool, so that no thread waits for a connection."""
        anyio.to_thread.current_default_thread_limiter().total_tokens = self.settings.db.threads

    async def verb(self, verb: str, names: list[str], actor: str, reason: str | None) -> VerbResult:
        if verb in JOBS:
            op_id, owner = await anyio.to_thread.run_sync(self._start_job, verb, names, actor, reason)
            task = asyncio.create_task(self._run(JOBS[verb], op_id, names, actor, owner))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            return VerbResult(
                verb=verb, nodes=[{"name": n, "status": "started"} for n in names], operation_id=op_id
            )
        if verb in ("drain", "resume"):
            await self._through_workload_manager(verb, names, actor, reason)
        moved = await anyio.to_thread.run_sync(self._apply, verb, names, actor, reason)
        return VerbResult(verb=verb, nodes=moved)

    async def operation(self, kind: str, names: list[str], actor: str, reason: str | None, fn: Job) -> int:
        """Run ``fn`` as an operation that moves no lifecycle state (power …): same locks, row and release."""
        op_id, owner = await anyio.to_thread.run_sync(self._start_job, kind, names, actor, reason, False)
        task = asyncio.create_task(self._run(fn, op_id, names, actor, owner))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return op_id

    async def _through_workload_manager(
        self, verb: str, names: list[str], actor: str, reason: str | None
    ) -> None:
        """Nodes in a deployed cluster are drained/resumed in it first (Slurm: ``bcm:`` reasons).

        Legality is checked before Slurm is touched; if Slurm fails, bcm's own state is left as it was.
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
            return [{"name": n.name, "status": "ok", "state": n.provision_state} for n in nodes]

    def _start_job(
        self, verb: str, names: list[str], actor: str, reason: str | None, transition: bool = True
    ) -> tuple[int, str]:
        """Lock the nodes and record the operation (in a worker thread); the caller starts the task."""
        owner = f"op-{uuid.uuid4().hex[:12]}"
        with session_scope(self.engine) as s:
            # lock first, then check legality: nothing starts if any node may not take the verb
            node_svc.acquire_locks(s, names, owner)
            moves = node_svc.check_verb(s, names, verb, lock_owner=owner) if transition else []
            for node, target in moves:
                node.target_state = target.value
                s.add(node)
            op = op_svc.create(s, verb, fold_hostlist(names), len(names), actor)
            op.log = f"{verb} {fold_hostlist(names)} by {actor}" + (f": {reason}" if reason else "") + "\n"
            op_id = op.id
        assert op_id is not None
        return op_id, owner

    async def _run(self, fn: Job, op_id: int, names: list[str], actor: str, owner: str) -> None:
        try:
            await fn(self, op_id, names, actor)
        except Exception as exc:  # a job bug must still close its operation
            log.exception("operation %s failed", op_id)
            await anyio.to_thread.run_sync(self._fail, op_id, f"{type(exc).__name__}: {exc}")
        finally:
            await anyio.to_thread.run_sync(self._release, names, owner)

    def _fail(self, op_id: int, error: str) -> None:
        with session_scope(self.engine) as s:
            op = op_svc.get(s, op_id)
            if not op_svc.is_finished(op):
                op_svc.finish(s, op, error)

    def _release(self, names: list[str], owner: str) -> None:
        with session_scope(self.engine) as s:
            node_svc.release_locks(s, names, owner)

    async def shutdown(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=5)
