"""Power operations and the periodic power-state read, both fanned out to BMCs with one concurrency cap.

``bcm power on gpu[01-64]`` becomes an operation of kind ``power-on`` (the work engine: a lease, node
locks, per-node results; resumable, so a reclaimed one acts on the nodes without a result only); one
BMC that hangs or rejects its password fails only its own node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import anyio
from sqlalchemy.engine import Engine

from bcm.db import session_scope
from bcm.domain.power import BmcTarget, BootDevice, PowerAction, PowerState
from bcm.drivers.power import (
    BmcAuthFailed,
    BmcBadAnswer,
    BmcCertChanged,
    BmcError,
    BmcRefused,
    BmcUnreachable,
    CallLimits,
    driver_for,
)
from bcm.services import operations as op_svc
from bcm.services import power as svc
from bcm.settings import Settings
from bcm.workers.job import Handler, Job, Starter
from bcm.workers.supervise import supervise

log = logging.getLogger("bcm.power")
FLUSH_EVERY_S = 0.5
POLL_PAGE = 500
POLL_ACTOR = "bcm:power"
_EXPECT = {
    PowerAction.ON: PowerState.ON,
    PowerAction.OFF: PowerState.OFF,
    PowerAction.CYCLE: PowerState.ON,
    PowerAction.PXE: PowerState.ON,
}


def limits(settings: Settings) -> CallLimits:
    p = settings.power
    return CallLimits(p.timeout_s, p.retries, p.ipmi_cipher_suite, p.redfish_tls)


def _error_status(exc: BmcError) -> str:
    for cls, status in (
        (BmcAuthFailed, "auth_failed"),
        (BmcUnreachable, "unreachable"),
        (BmcBadAnswer, "bad_answer"),
        (BmcRefused, "refused"),
        (BmcCertChanged, "tls_changed"),
    ):
        if isinstance(exc, cls):
            return status
    return "error"


async def act(target: BmcTarget, action: PowerAction, call_limits: CallLimits) -> dict[str, Any]:
    """One node's action as a result entry; never raises for a BMC's failure.

    An entry may carry ``tls_pin``, the certificate a first contact saw, for ``record_results`` to pin.
    """
    driver = driver_for(target, call_limits)
    entry = await _act(driver, action)
    if target.tls_pin is None and driver.tls_pin_seen:
        entry["tls_pin"] = driver.tls_pin_seen
    return entry


def shown(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Result entries as an operation shows them (without the certificate to pin)."""
    return {n: {k: v for k, v in r.items() if k != "tls_pin"} for n, r in results.items()}


async def _act(driver: Any, action: PowerAction) -> dict[str, Any]:
    try:
        if action is PowerAction.STATUS:
            state = (await driver.status()).value
            return {"status": "ok", "power": state, "message": f"power {state}"}
        if action is PowerAction.ON:
            await driver.on()
        elif action is PowerAction.OFF:
            await driver.off()
        elif action is PowerAction.SOFT_OFF:
            await driver.soft_off()
        elif action is PowerAction.CYCLE:
            await driver.cycle()
        elif action is PowerAction.PXE:
            await driver.set_next_boot(BootDevice.PXE)
            await driver.cycle()  # on when off, else a fresh start: either way it boots from the network
    except BmcError as exc:
        return {"status": _error_status(exc), "message": exc.message, "attempts": exc.attempts}
    expected = _EXPECT.get(action)
    entry: dict[str, Any] = {"status": "ok", "message": f"{action.value} accepted by the BMC"}
    if expected is not None:
        entry["power"] = expected.value
    return entry


async def fan_out(
    targets: list[BmcTarget],
    action: PowerAction,
    call_limits: CallLimits,
    concurrency: int,
    on_result: Callable[[str, dict[str, Any]], None],
) -> None:
    """Every target at most ``concurrency`` at a time; each result handed over as soon as it is known."""
    gate = asyncio.Semaphore(concurrency)

    async def one(target: BmcTarget) -> None:
        async with gate:
            try:
                result = await act(target, action, call_limits)
            except Exception as exc:  # a bug for one node must not lose the others
                log.exception("power %s on %s failed", action.value, target.node)
                result = {"status": "error", "message": f"{type(exc).__name__}: {exc}"}
        on_result(target.node, result)

    await asyncio.gather(*(one(t) for t in targets))


def handler(action: PowerAction) -> Handler:
    async def power_job(job: Job) -> None:
        await run_operation(job.engine, job.settings, job.op_id, job.names, action, job.actor)

    return Handler(power_job)


async def run_operation(
    engine: Engine, settings: Settings, op_id: int, names: list[str], action: PowerAction, actor: str
) -> None:
    def load() -> svc.Targets:
        with session_scope(engine) as s:
            return svc.load_targets(s, settings.state_dir, names)

    targets = await anyio.to_thread.run_sync(load)
    pending: dict[str, dict[str, Any]] = {
        name: {"status": "no_bmc", "message": why} for name, why in targets.missing.items()
    }
    done = asyncio.Event()

    def flush(batch: dict[str, dict[str, Any]]) -> None:
        with session_scope(engine) as s:
            op = op_svc.get(s, op_id)
            if op.started_at is None:
                op_svc.start(s, op)
            if batch:
                svc.record_results(s, action, batch, actor)
                lines = "".join(f"{n}: {r['status']} {r.get('message', '')}\n" for n, r in batch.items())
                op_svc.add_results(s, op, shown(batch), lines)

    async def flusher() -> None:
        while True:
            finished = done.is_set()
            batch = dict(pending)
            pending.clear()
            if batch or finished:
                await anyio.to_thread.run_sync(flush, batch)
            if finished:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), FLUSH_EVERY_S)

    flushing = asyncio.create_task(flusher())
    try:
        await fan_out(
            targets.reachable, action, limits(settings), settings.power.concurrency, pending.__setitem__
        )
    finally:
        done.set()
        await flushing

    def finish() -> None:
        with session_scope(engine) as s:
            op_svc.finish(s, op_svc.get(s, op_id))

    await anyio.to_thread.run_sync(finish)


async def start(
    runner: Starter, action: PowerAction, names: list[str], actor: str, reason: str | None
) -> int:
    """Start a power operation; the nodes are locked until every BMC answered or timed out."""
    return await runner.submit(f"power-{action.value}", names, actor, reason)


async def poll_once(engine: Engine, settings: Settings) -> int:
    """Read every BMC-equipped node's power state (a page at a time); returns how many were read."""
    after, read = "", 0
    while True:

        def page(after: str = after) -> tuple[list[str], svc.Targets]:
            with session_scope(engine) as s:
                names = svc.pollable(s, after, POLL_PAGE)
                return names, svc.load_targets(s, settings.state_dir, names)

        names, targets = await anyio.to_thread.run_sync(page)
        if not names:
            return read
        results: dict[str, dict[str, Any]] = {}
        await fan_out(
            targets.reachable,
            PowerAction.STATUS,
            limits(settings),
            settings.power.concurrency,
            results.__setitem__,
        )

        def store(results: dict[str, dict[str, Any]] = results) -> None:
            with session_scope(engine) as s:
                svc.record_results(s, PowerAction.STATUS, results, POLL_ACTOR)

        await anyio.to_thread.run_sync(store)
        read += len(results)
        after = names[-1]


async def poll_loop(engine: Engine, settings: Settings) -> None:
    """Read power states every ``settings.power.poll_interval_s`` (0: never), supervised."""
    interval = settings.power.poll_interval_s
    if interval <= 0:
        return
    await supervise(
        "power state poll", lambda: poll_once(engine, settings), interval, first_delay_s=interval, logger=log
    )
