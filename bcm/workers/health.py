"""GPU health in the background: carry out drain/resume decisions and mark silent nodes stale.

:func:`apply_pending` moves bcm's node state and then asks the node's workload manager to drain or
resume; a failure is retried (bounded) by the next sweep. :class:`HealthWorker` runs the periodic loop:
one pass per ``settings.health.interval_s``, cancellable, each pass bounded in rows. The first staleness
check waits ``stale_intervals`` intervals after start, so a head node that was down does not mark every
node stale before the agents have had a chance to report again.
"""

from __future__ import annotations

import asyncio
import logging

import anyio
from sqlalchemy.engine import Engine

from bcm.db import session_scope
from bcm.errors import BcmError
from bcm.services import health as svc
from bcm.settings import Settings
from bcm.workers.supervise import cancel, supervise

log = logging.getLogger("bcm.health")


async def wlm_apply(engine: Engine, settings: Settings, item: svc.PendingAction) -> str | None:
    """Drain or resume the node in its workload manager; None when it belongs to no deployed cluster.

    The workload manager's own view decides whose drain it is: a node already drained with a reason
    bcm did not write (Slurm: not starting with ``bcm:``) is an admin's, and bcm neither overwrites
    nor resumes it.
    """
    from bcm.drivers import wlm
    from bcm.drivers.ssh import SshClient, Target
    from bcm.errors import Conflict
    from bcm.services import wlm as wlm_svc
    from bcm.workers import wlm as wlm_jobs

    def owner() -> tuple[str, str, Target] | None:
        with session_scope(engine) as s:
            try:
                cluster = next(iter(wlm_svc.clusters_of(s, [item.node])))
            except Conflict:  # in no deployed workload manager: bcm's node state is all there is
                return None
            row = wlm_svc.get(s, cluster)
            return cluster, row.kind, wlm_svc.controller(s, row, settings.state_dir, settings.ssh.port)

    found = await anyio.to_thread.run_sync(owner)
    if found is None:
        return None
    cluster, kind, controller = found
    manager = wlm.get(kind)
    where = f"{manager.title} {cluster}"
    current = (await manager.node_states(SshClient.from_settings(settings), controller)).get(item.node)
    admins = current is not None and bool(current.reason) and not manager.drained_by_bcm(current)
    if item.action == svc.DRAIN:
        if admins and current is not None and manager.is_drained(current):
            return f"{where}: already drained by an admin ({current.reason}); left alone"
        await wlm_jobs.drain(engine, settings, [item.node], item.reason, svc.ACTOR)
        return f"{where}: drained"
    if admins:
        return f"{where}: an admin drained it since ({current.reason if current else ''}); left alone"
    await wlm_jobs.resume(engine, settings, [item.node], svc.ACTOR)
    return f"{where}: resumed"


async def apply_pending(engine: Engine, settings: Settings, node_ids: list[int] | None = None) -> int:
    """Carry out pending drains/resumes (of ``node_ids``, or any); returns how many were handled."""

    def claim() -> list[svc.PendingAction]:
        with session_scope(engine) as s:
            return svc.claim_pending(s, node_ids)

    def finish(item: svc.PendingAction, outcome: str | None, error: str | None) -> None:
        with session_scope(engine) as s:
            svc.finish_pending(s, item, outcome=outcome, error=error)

    items = await anyio.to_thread.run_sync(claim)
    for item in items:
        outcome, error = None, None
        try:
            outcome = await asyncio.wait_for(wlm_apply(engine, settings, item), timeout=120)
        except BcmError as exc:
            error = exc.message
        except TimeoutError:
            error = "the workload manager did not answer within 120 s"
        except Exception as exc:  # a bug in one node's action must not stop the others
            log.exception("health %s of %s failed", item.action, item.node)
            error = f"{type(exc).__name__}: {exc}"
        await anyio.to_thread.run_sync(finish, item, outcome, error)
    return len(items)


def sweep_once(engine: Engine, settings: Settings) -> list[str]:
    """One staleness pass; returns the nodes newly marked stale."""
    with session_scope(engine) as s:
        return svc.sweep_stale(s, settings.health)


class HealthWorker:
    """The periodic loop, supervised; ``start()`` in the server's lifespan, ``await stop()`` on shutdown."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self.task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._sweep_from: float | None = None

    def start(self) -> None:
        if self.task is None:
            passes = supervise(
                "health drains and staleness",
                self.one_pass,
                self.settings.health.interval_s,
                wake=self._wake,
                logger=log,
            )
            self.task = asyncio.create_task(passes, name="bcm-health")

    def kick(self) -> None:
        """Run a pass now (a decision was just recorded)."""
        self._wake.set()

    async def stop(self) -> None:
        await cancel(self.task)
        self.task = None

    async def one_pass(self) -> None:
        """Carry out pending drains/resumes; mark silent nodes stale once the first agents had their chance."""
        health = self.settings.health
        now = asyncio.get_running_loop().time()
        if self._sweep_from is None:
            self._sweep_from = now + health.interval_s * health.stale_intervals
        await apply_pending(self.engine, self.settings)
        if now >= self._sweep_from:
            stale = await anyio.to_thread.run_sync(sweep_once, self.engine, self.settings)
            if stale:
                log.warning("%d node(s) stopped reporting GPU health: %s", len(stale), ", ".join(stale[:10]))

    async def run(self, passes: int) -> None:
        """``passes`` passes one after the other (tests; the server supervises them: :meth:`start`)."""
        for _ in range(passes):
            await self.one_pass()
