"""Provisioning: the queue behind ``provision``/``reimage``, the PXE power step, the deadline, and dnsmasq.

A verb moves nodes to ``provisioning`` and queues them (one transaction). The Provisioner loop, every
``TICK_S`` and whenever woken: fails nodes past their deadline; starts the oldest queued nodes so that at
most ``pxe.max_concurrent`` provision at once; for those, a ``provision`` operation (the work engine: a
lease, node locks, per-node results) sets next boot to PXE through each BMC and power-cycles it. A BMC that
refuses fails its node. The node's callback (``POST /boot/v1/hello``) moves it to ``booted``, and an SSH
inventory with its pinned host key follows. Everything lives in the node rows, so a restarted server
resumes waiting, and fails at once what timed out while it was down.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import anyio
from sqlalchemy.engine import Engine

from bcm.db import session_scope
from bcm.domain.power import PowerAction
from bcm.domain.states import State
from bcm.drivers import dnsmasq
from bcm.errors import BcmError, LockHeld
from bcm.models.base import utcnow
from bcm.models.node import VerbResult
from bcm.services import nodes as node_svc
from bcm.services import operations as op_svc
from bcm.services import pxe
from bcm.settings import Settings
from bcm.workers import power as power_worker
from bcm.workers.job import Handler, Job, Starter
from bcm.workers.supervise import cancel, supervise

log = logging.getLogger("bcm.provision")
TICK_S = 2.0
ACTOR = "bcm:provision"
INVENTORY_TRIES = 10
INVENTORY_RETRY_S = 3.0


async def provision_verb(
    runner: Starter, verb: str, names: list[str], actor: str, reason: str | None, rekey: bool = False
) -> VerbResult:
    """``provision``/``reimage``: legal for every node or for none; queued in the same transaction. With
    ``rekey`` (admin) bcm makes new host keys for them in that transaction too (``node.rekey`` events)."""

    def apply() -> list[dict[str, Any]]:
        with session_scope(runner.engine) as s:
            nodes = node_svc.apply_verb(s, names, verb, actor, reason)
            if rekey:
                node_svc.regenerate_host_keys(s, nodes, runner.settings.state_dir, actor)
            pxe.queue(s, nodes)
            return [{"name": n.name, "status": "queued", "state": n.provision_state} for n in nodes]

    moved = await anyio.to_thread.run_sync(apply)
    provisioner = getattr(runner, "provisioner", None)
    if provisioner is not None:
        provisioner.wake()
    return VerbResult(verb=verb, nodes=moved)


class Provisioner:
    def __init__(
        self, engine: Engine, settings: Settings, runner: Any, dhcp: dnsmasq.Supervisor | None
    ) -> None:
        self.engine, self.settings, self.runner, self.dhcp = engine, settings, runner, dhcp
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        rounds = supervise("provisioning round", self.tick, TICK_S, wake=self._wake, logger=log)
        self._task = asyncio.create_task(rounds, name="bcm-provisioner")

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        for task in [self._task, *self.tasks]:
            await cancel(task)

    async def tick(self) -> list[str]:
        """One round; returns the nodes it started."""

        def plan() -> tuple[list[str], list[str]]:
            with session_scope(self.engine) as s:
                now = utcnow()
                return pxe.timed_out(s, now), pxe.claim(s, self.settings, now)

        failed, started = await anyio.to_thread.run_sync(plan)
        for name in failed:
            log.warning("provisioning %s failed: no callback before its deadline", name)
        if self.dhcp is not None and (failed or started):
            await self.dhcp.sync()
        if started:
            try:
                await self.runner.submit("provision", started, ACTOR, "network boot")
            except BcmError as exc:  # locked meanwhile: back in the queue for the next round
                log.warning("provisioning %s waits: %s", ",".join(started), exc.message)
                await anyio.to_thread.run_sync(self._unclaim, started)
        return started

    def _unclaim(self, names: list[str]) -> None:
        with session_scope(self.engine) as s:
            for node in node_svc.get_many(s, names):
                if node.provision_state == State.PROVISIONING.value:
                    node.provision_started_at = node.provision_deadline = None
                    s.add(node)

    def booted(self, name: str) -> None:
        """A node called back: inventory it over SSH (its pinned host key) once its locks are free."""
        task = asyncio.create_task(self._inventory(name), name=f"bcm-inventory-{name}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _inventory(self, name: str) -> None:
        for _ in range(INVENTORY_TRIES):
            try:
                await self.runner.submit("inventory", [name], ACTOR, "booted: first inventory")
                return
            except LockHeld:  # the power operation still holds the node
                await asyncio.sleep(INVENTORY_RETRY_S)
            except BcmError as exc:
                log.warning("inventory of booted node %s did not start: %s", name, exc.message)
                return
        log.warning("inventory of booted node %s did not start: the node stayed locked", name)


async def _pxe_step(job: Job) -> None:
    """The ``provision`` operation: next boot PXE and a power cycle through each BMC; a BMC that refuses
    fails its node's provisioning."""
    await power_worker.run_operation(
        job.engine, job.settings, job.op_id, job.names, PowerAction.PXE, job.actor
    )

    def fail_refused() -> None:
        with session_scope(job.engine) as s:
            results = op_svc.get(s, job.op_id).results or {}
            for node in node_svc.get_many(s, job.names):
                r = results.get(node.name) or {"status": "error", "message": "no answer recorded"}
                if r.get("status") != "ok" and node.provision_state == State.PROVISIONING.value:
                    pxe.fail(
                        s,
                        node,
                        f"provisioning: PXE power-cycle failed ({r.get('status')}): {r.get('message', '')}",
                    )

    await anyio.to_thread.run_sync(fail_refused)


def _pxe_timeout(settings: Settings, _n: int) -> float:
    return settings.power.timeout_s * (settings.power.retries + 1) * 2 + 60


PXE_STEP = Handler(_pxe_step, timeout=_pxe_timeout)


def make_dhcp(engine: Engine, settings: Settings) -> dnsmasq.Supervisor:
    def entries() -> list[tuple[str, str | None, str]]:
        with session_scope(engine) as s:
            return pxe.host_entries(s)

    return dnsmasq.Supervisor(settings, entries)


def load_config(engine: Engine, settings: Settings) -> None:
    """At start: what `bcm pxe enable|disable` stored overrides the BCM_PXE__* settings."""
    with session_scope(engine) as s:
        settings.pxe = pxe.effective(settings, pxe.stored_config(s))


async def reconfigure(app: Any) -> None:
    """Start, restart or stop dnsmasq for the settings now in ``app.state.settings.pxe``."""
    engine, settings = app.state.engine, app.state.settings
    old = getattr(app.state, "dhcp", None)
    if old is not None:
        await old.stop()
    from bcm.workers import leader

    # dnsmasq runs on the leader only (bcm.workers.leader): another server stores the settings, no more
    app.state.dhcp = make_dhcp(engine, settings) if settings.pxe.enabled and leader.leading(app) else None
    if app.state.dhcp is not None:
        await app.state.dhcp.start(pxe.server_url(settings) + "/boot/v1/ipxe/boot.ipxe")
    if getattr(app.state, "provisioner", None) is not None:
        app.state.provisioner.dhcp = app.state.dhcp
