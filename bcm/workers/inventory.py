"""The ``inventory`` operation: the fact script over SSH on many nodes at once, each host's result
stored as it comes (:mod:`bcm.services.inventory`). Resumable: a reclaimed inventory runs again for the
nodes without a result."""

from __future__ import annotations

import asyncio

import anyio
from sqlmodel import select

from bcm.agent.facts import FACT_SCRIPT
from bcm.db import session_scope
from bcm.drivers import ssh
from bcm.models.node import Node
from bcm.services import inventory as svc
from bcm.services import operations as op_svc
from bcm.workers.job import Handler, Job

FLUSH_EVERY_S = 0.5


async def inventory_job(job: Job) -> None:
    settings, engine, op_id, names, actor = job.settings, job.engine, job.op_id, job.names, job.actor
    targets, missing = await anyio.to_thread.run_sync(svc.load_targets, engine, names)
    pending: list[ssh.HostResult] = []
    done = asyncio.Event()

    def flush(batch: list[ssh.HostResult], missing_now: dict[str, str]) -> None:
        with session_scope(engine) as s:
            results = {r.name: svc.store_result(s, r, actor) for r in batch}
            for name, why in missing_now.items():
                node = s.exec(select(Node).where(Node.name == name)).one()
                node.target_state, node.last_error = None, f"inventory: {why}"
                s.add(node)
                results[name] = {"status": "no_address", "message": why}
            op = op_svc.get(s, op_id)
            if op.started_at is None:
                op_svc.start(s, op)
            log_lines = "".join(f"{n}: {r['status']} {r.get('message', '')}\n" for n, r in results.items())
            op_svc.add_results(s, op, results, log_lines)

    async def flusher() -> None:
        while not (done.is_set() and not pending):
            await asyncio.sleep(FLUSH_EVERY_S)
            batch = pending[:]
            del pending[: len(batch)]
            if batch:
                await anyio.to_thread.run_sync(flush, batch, {})

    await anyio.to_thread.run_sync(flush, [], missing)
    flushing = asyncio.create_task(flusher())
    try:
        client = ssh.SshClient.from_settings(settings)
        await client.run_many(
            [ssh.Target(t.name, t.address, settings.ssh.port, t.pinned_key) for t in targets],
            FACT_SCRIPT,
            on_result=pending.append,
        )
    finally:
        done.set()
        await flushing

    def finish() -> None:
        with session_scope(engine) as s:
            op_svc.finish(s, op_svc.get(s, op_id))

    await anyio.to_thread.run_sync(finish)


HANDLER = Handler(inventory_job, moves_state=True)
