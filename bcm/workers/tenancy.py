"""Tenancy on the running workload manager: plan (a diff, nothing changed), apply (idempotent), usage.

Each asks the cluster's :class:`~bcm.drivers.wlm.WorkloadManager` by its kind; the database is read
in short transactions, never held across SSH. Apply is a ``tenancy.apply`` operation like every long
verb: the cluster's nodes locked under its lease, bounded in time, one result per node (its Unix
users made), the plan it ran as the operation's ``outcome``; resumable, since applying again changes
nothing that is already right.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import anyio
from sqlalchemy.engine import Engine
from sqlmodel import Session

from bcm.db import session_scope
from bcm.drivers import wlm
from bcm.drivers.ssh import SshClient, Target
from bcm.errors import BcmError
from bcm.models.operation import Operation
from bcm.services import events
from bcm.services import operations as op_svc
from bcm.services import tenancy as svc
from bcm.services import wlm as wlm_svc
from bcm.settings import Settings
from bcm.workers.job import Handler, Job, Starter, fan_out_timeout


def _load(engine: Engine, settings: Settings, cluster: str | None) -> dict[str, Any]:
    with session_scope(engine) as s:
        row = wlm_svc.pick(s, cluster)
        port = settings.ssh.port
        targets: list[Target] = [wlm_svc.controller(s, row, settings.state_dir, port)]
        ctl = targets[0].name
        for node in wlm_svc.members(s, row):
            if node.name == ctl:
                continue
            ip = wlm_svc._addresses(s, [node])[node.name]
            if ip:
                targets.append(Target(node.name, ip, port, node.ssh_host_key))
        accounts = svc.accounts(s)
        users = sorted({u for a in accounts for u in a.users})
        return {
            "cluster": row.name,
            "kind": row.kind,
            "controller": targets[0],
            "nodes": targets,
            "accounts": accounts,
            "uids": svc.unix_ids(s, users),
        }


def _public(plan: wlm.TenancyPlan) -> dict[str, Any]:
    return {
        "cluster": plan.cluster,
        "applied": plan.applied,
        "changes": [asdict(c) for c in plan.changes],
        "drift": sum(1 for c in plan.changes if c.drift),
        "notes": plan.notes,
    }


async def plan(engine: Engine, settings: Settings, cluster: str | None) -> dict[str, Any]:
    got = await anyio.to_thread.run_sync(_load, engine, settings, cluster)
    manager = wlm.get(got["kind"])
    previous = svc.previous(settings.state_dir, got["cluster"])
    result = await manager.tenancy_plan(
        SshClient.from_settings(settings),
        got["controller"],
        got["cluster"],
        got["accounts"],
        previous=previous,
    )
    return _public(result)


async def start_apply(runner: Starter, cluster: str | None, actor: str) -> dict[str, Any]:
    """Start ``tenancy.apply`` on the cluster (default: the only one); 404 when there is none."""
    op_id = await runner.submit("tenancy.apply", [], actor, None, extra=cluster)

    def picked() -> str:
        with session_scope(runner.engine) as s:
            return str((op_svc.get(s, op_id).spec or {})["cluster"])

    return {"cluster": await anyio.to_thread.run_sync(picked), "operation_id": op_id}


def _apply_setup(s: Session, op: Operation, cluster: Any) -> list[str]:
    row = wlm_svc.pick(s, cluster)
    ctl = wlm_svc.controller_target(s, row)[0]
    op.spec = {"cluster": row.name}
    return list(dict.fromkeys([ctl, *wlm_svc.member_names(s, row)]))


async def _apply_run(job: Job) -> None:
    def begin() -> None:
        with session_scope(job.engine) as s:
            op_svc.start(s, op_svc.get(s, job.op_id))

    await anyio.to_thread.run_sync(begin)
    try:
        result = await apply(job.engine, job.settings, job.spec["cluster"], job.actor)
    except BcmError as exc:
        failed = {n: {"status": "failed", "message": exc.message} for n in job.names}
        await anyio.to_thread.run_sync(_record, job, failed, None, exc.message)
        return
    done = {n: {"status": "ok", "message": "users and accounts applied"} for n in job.names}
    await anyio.to_thread.run_sync(_record, job, done, result, None)


def _record(
    job: Job, results: dict[str, dict[str, Any]], outcome: dict[str, Any] | None, error: str | None
) -> None:
    with session_scope(job.engine) as s:
        op = op_svc.get(s, job.op_id)
        changes = len(outcome["changes"]) if outcome else 0
        op_svc.add_results(s, op, results, f"{changes} changes\n" if outcome else "")
        op.outcome = outcome
        op_svc.finish(s, op, error)


def _apply_timeout(settings: Settings, n: int) -> float:
    return fan_out_timeout(settings, n) + settings.ssh.command_timeout_s * 4  # the controller's steps


APPLY = Handler(_apply_run, timeout=_apply_timeout, setup=_apply_setup)


async def apply(engine: Engine, settings: Settings, cluster: str | None, actor: str) -> dict[str, Any]:
    """Make the members' users and run the plan now (the body of a ``tenancy.apply`` operation)."""
    got = await anyio.to_thread.run_sync(_load, engine, settings, cluster)
    manager = wlm.get(got["kind"])
    previous = svc.previous(settings.state_dir, got["cluster"])
    result = await manager.tenancy_apply(
        SshClient.from_settings(settings),
        got["controller"],
        got["nodes"],
        got["cluster"],
        got["accounts"],
        previous=previous,
        uids=got["uids"],
    )
    svc.remember(settings.state_dir, got["cluster"], got["accounts"])

    def record() -> None:
        with session_scope(engine) as s:
            drift = sum(1 for c in result.changes if c.drift)
            events.record(
                s, actor, "tenancy.applied", got["cluster"], f"{len(result.changes)} changes ({drift} drift)"
            )

    await anyio.to_thread.run_sync(record)
    return _public(result)


async def usage(engine: Engine, settings: Settings, project: str) -> dict[str, Any] | None:
    """The workload manager's figures for one project; None when no cluster is there to ask."""

    def load() -> dict[str, Any] | None:
        with session_scope(engine) as s:
            clusters = wlm_svc.query(s)
            if len(clusters) != 1 or clusters[0].state not in ("deployed", "partial"):
                return None
        return _load(engine, settings, None)

    got = await anyio.to_thread.run_sync(load)
    if got is None:
        return None
    figures = await wlm.get(got["kind"]).usage(
        SshClient.from_settings(settings), got["controller"], [project]
    )
    found = figures.get(project)
    return {"cluster": got["cluster"], **asdict(found)} if found else None
