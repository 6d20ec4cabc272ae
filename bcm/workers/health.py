"""GPU health in the background: carry out drain/resume decisions and mark silent nodes stale.

:func:`apply_pending` moves bcm's node state and then asks the workload manager (Slurm) to drain or
resume; a failure is retried (bounded) by the next sweep. :class:`HealthWorker` runs the periodic loop:
one pass per ``settings.health.interval_s``, cancellable, each pass bounded in rows. The first staleness
check waits ``stale_intervals`` intervals after start, so a head node that was down does not mark every
node stale before the agents have had a chance to report again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import anyio
from sqlalchemy.engine import Engine

from bcm.db import session_scope
from bcm.errors import BcmError
from bcm.services import health as svc
from bcm.settings import Settings

log = logging.getLogger("bcm.health")


async def wlm_apply(engine: Engine, settings: Settings, item: svc.PendingAction) -> str | None:
    """Drain or resume the node in its workload manager; None when it belongs to none (or none exists).

    Hook into :mod:`bcm.services.wlm`: ``health_drain(engine, settings, node, reason)`` and
    ``health_resume(engine, settings, node)``, each returning a short outcome (or None when the node is
    in no cluster) and raising a ``DriverError`` on failure. Resume must leave a drain whose reason does
    not start with ``bcm:`` alone (an admin's).
    """
    try:
        from bcm.services import wlm
    except ImportError:
        return None
    hook: Any = getattr(wlm, "health_drain" if item.action == svc.DRAIN else "health_resume", None)
    if hook is None:
        return None
    if item.action == svc.DRAIN:
        outcome = await hook(engine, settings, item.node, item.reason or "bcm: GPU health FAIL")
    else:
        outcome = await hook(engine, settings, item.node)
    return None if outcome is None else str(outcome)


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
    """The periodic loop; ``start()`` in the server's lifespan, ``await stop()`` on shutdown."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self.task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def start(self) -> None:
        if self.task is None:
            self.task = asyncio.create_task(self.run(), name="bcm-health")

    def kick(self) -> None:
        """Run a pass now (a decision was just recorded)."""
        self._wake.set()

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None

    async def run(self, passes: int | None = None) -> None:
        """Loop until cancelled (or for ``passes`` passes, for tests)."""
        health = self.settings.health
        loop = asyncio.get_running_loop()
        sweep_from = loop.time() + health.interval_s * health.stale_intervals
        done = 0
        while passes is None or done < passes:
            try:
                await apply_pending(self.engine, self.settings)
                if loop.time() >= sweep_from:
                    stale = await anyio.to_thread.run_sync(sweep_once, self.engine, self.settings)
                    if stale:
                        log.warning(
                            "%d node(s) stopped reporting GPU health: %s", len(stale), ", ".join(stale[:10])
                        )
            except asyncio.CancelledError:
                raise
            except Exception:  # the database may be briefly away; try again next interval
                log.exception("health sweep failed")
            done += 1
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=health.interval_s)
