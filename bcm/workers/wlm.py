"""Workload-manager background work: deploy and verify operations, drain/resume, and the loop that
copies the workload manager's node states into the database. Each step asks the cluster's
:class:`~bcm.drivers.wlm.WorkloadManager` (by its kind), never a workload manager by name.

Deploy order: lock the hosts, render, check the controller answers over SSH (if not, fail before
anything is touched), run the playbook (controller play first; compute nodes only if it passed),
wait for the deployed nodes to register, then the verification job (all or nothing).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from sqlalchemy.engine import Engine
from sqlmodel import Session

from bcm.db import session_scope
from bcm.domain.naming import fold_hostlist
from bcm.drivers import offload, wlm
from bcm.drivers.ssh import SshClient, Target
from bcm.errors import BcmError, Conflict, DriverError
from bcm.models.operation import Operation
from bcm.models.wlm import WlmDeployRequest, WlmStarted, WlmState
from bcm.services import events, wlm_usage
from bcm.services import nodes as node_svc
from bcm.services import operations as op_svc
from bcm.services import secrets as secret_svc
from bcm.services import wlm as svc
from bcm.settings import Settings
from bcm.workers.job import Handler, Job, Starter

log = logging.getLogger("bcm.wlm")

DEPLOY_TIMEOUT_S = 1800.0
REGISTER_TIMEOUT_S = 90.0
VERIFY_TIMEOUT_S = 120.0
SETTLE_S = 20.0  # after a verification job: how long its nodes may take to leave "completing"
BUSY = ("alloc", "complet", "mix")  # a node's state while the verification job still holds it
# a deploy's own bound (its locks last as long): the playbook, registration, the verification job
OPERATION_TIMEOUT_S = DEPLOY_TIMEOUT_S + REGISTER_TIMEOUT_S + VERIFY_TIMEOUT_S + 300.0
RESUME_WAIT_S = 30.0
SYNC_INTERVAL_S = 30.0


def _ssh(settings: Settings) -> SshClient:
    return SshClient.from_settings(settings)


def _controller(engine: Engine, settings: Settings, name: str) -> tuple[wlm.WorkloadManager, Target]:
    """The cluster's workload manager and how to reach its controller."""
    with session_scope(engine) as s:
        row = svc.get(s, name)
        target = svc.controller(s, row, settings.state_dir, settings.ssh.port)
        kind = row.kind
    return wlm.get(kind), target


# ---- deploy ----------------------------------------------------------------------------------------


async def start_deploy(
    runner: Starter, kind: str, req: WlmDeployRequest, actor: str, joining: list[str] | None = None
) -> WlmStarted:
    """Validate and lock synchronously (404/409 come back to the caller), then deploy in the background.

    A ``wlm.deploy`` operation: its row, lease and the locks of the controller and members in one
    transaction (``_deploy_setup``), a bound on its time; a failed or cancelled deploy leaves the
    cluster ``failed``, never ``deploying``. Resumable: Ansible's roles are idempotent, so a deploy
    whose server went away runs again on the server that takes it up.
    """
    spec: dict[str, Any] = {"cluster": req.name, "verify": req.verify}
    if joining:  # zero-touch: these join; each is verified on its own, ready only once its job passed
        spec["joining"] = joining
    op_id = await runner.submit(
        "wlm.deploy", [], actor, None, spec=spec, extra=(kind, req, actor, runner.settings.state_dir)
    )
    return WlmStarted(cluster=req.name, operation_id=op_id)


def _deploy_setup(s: Session, op: Operation, extra: Any) -> list[str]:
    kind, req, actor, state_dir = extra
    row = svc.plan_deploy(s, kind, req, actor)
    ctl = svc.controller_target(s, row)[0]
    members = svc.member_names(s, row)
    svc.keep_secrets(state_dir, kind, req)  # the secrets stay on disk, never in clear in the operation's spec
    carry_secrets(op, state_dir, req)
    op.log = (
        f"deploy {kind} cluster {row.name}: controller {ctl}, nodes {fold_hostlist(members)} by {actor}\n"
    )
    row.last_deploy_op = op.id
    s.add(row)
    return list(dict.fromkeys([ctl, *members]))


def _deploy_failed(s: Session, op: Operation, _settings: Settings, message: str) -> None:
    name = str((op.spec or {}).get("cluster"))
    if svc.get(s, name).state == WlmState.DEPLOYING:
        svc.finish_deploy(s, name, ok_nodes=[], failed={}, error=message, actor="bcm")


@dataclass(frozen=True)
class _DeploySpec:
    name: str
    verify: bool
    joining: tuple[str, ...] = ()


async def _deploy_run(job: Job) -> None:
    spec = _DeploySpec(job.spec["cluster"], bool(job.spec["verify"]), tuple(job.spec.get("joining") or ()))
    if job.claims > 1 and job.spec.get("secrets_enc"):
        await anyio.to_thread.run_sync(restore_secrets, job)
    await _deploy(job, job.op_id, spec, job.actor)


def carry_secrets(op: Operation, state_dir: Path, req: WlmDeployRequest) -> None:
    """The request's write-only values into the operation's spec, encrypted with secret.key (which the
    heads share), for a server that takes the deploy up (:func:`restore_secrets`)."""
    if kept := req.secrets():
        op.spec = {**(op.spec or {}), "secrets_enc": secret_svc.encrypt(state_dir, json.dumps(kept))}


def restore_secrets(job: Job) -> None:
    """A deploy taken up from another server: the write-only values its request gave (kept in that
    server's state directory) written into this server's, from the operation's encrypted copy. A key that
    cannot read them (secret.key not shared) fails the deploy with that reason, before anything runs."""
    name = str(job.spec["cluster"])
    with session_scope(job.engine) as s:
        kind = svc.get(s, name).kind
    kept = json.loads(secret_svc.decrypt(job.settings.state_dir, str(job.spec["secrets_enc"])))
    wlm.get(kind).keep_secrets(svc.secrets_dir(job.settings.state_dir, name), kept)


DEPLOY = Handler(
    _deploy_run, timeout=lambda _s, _n: OPERATION_TIMEOUT_S, setup=_deploy_setup, on_error=_deploy_failed
)


async def _deploy(runner: Job, op_id: int, req: _DeploySpec, actor: str) -> None:
    engine, settings = runner.engine, runner.settings

    def plan() -> tuple[wlm.WorkloadManager, wlm.DeployPlan]:
        with session_scope(engine) as s:
            op_svc.start(s, op_svc.get(s, op_id))
            return wlm.get(svc.get(s, req.name).kind), svc.build_plan(s, settings.state_dir, req.name)

    manager, p = await anyio.to_thread.run_sync(plan)
    ssh = _ssh(settings)
    ctl_host = next(h for h in p.hosts if h.name == p.controller)
    ctl_target = wlm.Controller(
        ctl_host.name,
        ctl_host.address,
        settings.ssh.port,
        ctl_host.host_key,
        svc.secrets_dir(settings.state_dir, req.name),
    )
    probe = await ssh.run_one(ctl_target, "true")
    if not probe.ok:
        reason = f"controller {p.controller} unreachable: {probe.status.value}: {probe.error}"
        await anyio.to_thread.run_sync(_record_hosts, engine, op_id, req.name, p, {}, reason, actor)
        await anyio.to_thread.run_sync(_finish_op, engine, op_id, reason)
        return

    access = wlm.AnsibleAccess(
        key_file=settings.ssh_key_file,
        work_dir=settings.state_dir / "ansible",
        username=settings.ssh.username,
        connect_timeout_s=settings.ssh.connect_timeout_s,
    )
    result = await offload.run("ansible", manager.deploy, p, access, DEPLOY_TIMEOUT_S)  # not a request thread
    per_host: dict[str, dict[str, Any]] = {}
    for name, recap in result.hosts.items():
        entry: dict[str, Any] = {"status": recap.status, "changed": recap.changed, "ok_tasks": recap.ok}
        if recap.error:
            entry["error"] = recap.error
        elif recap.status == "not_run":
            entry["error"] = (
                "not deployed: the controller play failed" if result.status != "timeout" else "timed out"
            )
        per_host[name] = entry
    ctl = per_host.get(p.controller, {})
    error = None
    if ctl.get("status") != "ok":
        error = f"controller {p.controller}: {ctl.get('error') or ctl.get('status')}"
    elif result.status == "timeout":
        error = f"playbook did not finish within {DEPLOY_TIMEOUT_S:.0f}s"
    log_text = (
        f"ansible: {result.status} rc={result.rc} changed={result.changed} in {result.duration_s:.1f}s\n"
    )
    log_text += "".join(f"  {e}\n" for e in result.errors[:50])
    log_text += "".join(f"changed: {t}\n" for t in result.changed_tasks[:100])
    log_text += "".join(f"{n}\n" for n in result.notes[:200])
    log_text += "slowest tasks: " + ", ".join(f"{t} {d:.1f}s" for t, d in result.slowest()) + "\n"
    if result.rc != 0 and not result.errors:  # the run itself failed (syntax, inventory): show its output
        log_text += result.output_tail[-3000:] + "\n"

    deployed = [n for n in p.members if per_host.get(n, {}).get("status") == "ok"]
    if error is None and deployed:
        states = await manager.wait_registered(
            ssh,
            ctl_target,
            deployed,
            timeout_s=REGISTER_TIMEOUT_S,
        )
        for n in deployed:
            st = states.get(n)
            per_host[n][f"{manager.kind}_state"] = st.state if st else None
            if not manager.is_responding(st):
                per_host[n].update(
                    status="failed",
                    error=f"{manager.node_agent} did not register ({st.state if st else 'unknown'})",
                )
        await anyio.to_thread.run_sync(
            _store_states, engine, req.name, {k: v.state for k, v in states.items()}
        )
    verify_error = None
    unregistered = [n for n in deployed if per_host[n]["status"] != "ok"]
    if error is None and req.joining:
        # zero-touch: the joining nodes are ready only once their own one-node job passed
        await anyio.to_thread.run_sync(
            _record_hosts, engine, op_id, req.name, p, per_host, error, actor, log_text, set(req.joining)
        )
        verify_error = await _verify_joining(runner, op_id, req.name, list(req.joining), per_host, actor)
        await anyio.to_thread.run_sync(_finish_op, engine, op_id, verify_error)
        return
    elif error is None and req.verify and unregistered:
        # a job on nodes the controller does not see would only say "nodes are busy"
        log_text += f"verify: skipped: {fold_hostlist(unregistered)} did not register with the controller\n"
    elif error is None and req.verify and deployed:
        # the deploy is recorded first, so the verify job sees the cluster as deployed
        await anyio.to_thread.run_sync(
            _record_hosts, engine, op_id, req.name, p, per_host, error, actor, log_text
        )
        verified = await _verify(runner, op_id, req.name, actor, record_on_op=False)
        verify_error = None if verified.ok else f"verification job failed: {verified.message}"
        await anyio.to_thread.run_sync(_finish_op, engine, op_id, verify_error)
        return
    if req.joining:  # the deploy failed (or left them out): they did not join
        await anyio.to_thread.run_sync(
            _record_hosts, engine, op_id, req.name, p, per_host, error, actor, log_text, set(req.joining)
        )
        why = error or "; ".join(
            f"{n}: {per_host.get(n, {}).get('error') or 'not deployed'}" for n in req.joining
        )
        await anyio.to_thread.run_sync(
            _fail_joining, engine, list(req.joining), f"zero-touch join failed: {why}"
        )
        await anyio.to_thread.run_sync(_finish_op, engine, op_id, error or why)
        return
    await anyio.to_thread.run_sync(
        _record_hosts, engine, op_id, req.name, p, per_host, error, actor, log_text
    )
    await anyio.to_thread.run_sync(_finish_op, engine, op_id, error)


def _fail_joining(engine: Engine, names: list[str], why: str) -> None:
    with session_scope(engine) as s:
        svc.fail_joining(s, names, why, "bcm:zero-touch")


async def _verify_joining(
    runner: Job, op_id: int, name: str, joining: list[str], per_host: dict[str, dict[str, Any]], actor: str
) -> str | None:
    """One verification job per joining node: pass → ready; fail (or not deployed) → failed with the job's
    output in last_error. The operation's error names the nodes that failed (None: all joined)."""
    engine, settings = runner.engine, runner.settings
    manager, target = await anyio.to_thread.run_sync(_controller, engine, settings, name)

    def gpu_nodes() -> set[str]:
        with session_scope(engine) as s:
            nodes = node_svc.get_many(s, joining)
            ids = svc.nodes_with_gpus(s, [n.id for n in nodes if n.id is not None])
            return {n.name for n in nodes if n.id in ids}

    with_gpus = await anyio.to_thread.run_sync(gpu_nodes)
    client = _ssh(settings)
    failed: dict[str, str] = {}
    lines = []
    for n in joining:
        if per_host.get(n, {}).get("status") != "ok":
            failed[n] = (
                f"zero-touch join failed: deploy: {per_host.get(n, {}).get('error') or 'not deployed'}"
            )
            lines.append(f"join {n}: not deployed\n")
            continue
        try:
            result = await manager.verify(
                client, target, [n], timeout_s=VERIFY_TIMEOUT_S, gpus=n in with_gpus
            )
        except DriverError as exc:
            result = wlm.VerifyResult(False, exc.message)
        lines.append(f"verify {n}: {'passed' if result.ok else 'FAILED'}: {result.message}\n")
        if not result.ok:
            failed[n] = f"zero-touch join: verification job failed: {result.message}\n{result.output[-1500:]}"

    def record() -> None:
        with session_scope(engine) as s:
            ok = [n for n in joining if n not in failed]
            if ok:
                node_svc.join_workload_manager(s, ok)
            for n, why in failed.items():
                svc.fail_joining(s, [n], why, actor)
            op = op_svc.get(s, op_id)
            results = {
                n: {"status": "failed", "error": failed[n][:500]}
                if n in failed
                else {"status": "ok", "joined": True}
                for n in joining
            }
            op_svc.add_results(s, op, results, "".join(lines))

    await anyio.to_thread.run_sync(record)
    await _settle_states(manager, client, target, engine, name, joining)
    return f"did not join: {fold_hostlist(sorted(failed))}" if failed else None


def _record_hosts(
    engine: Engine,
    op_id: int,
    name: str,
    p: wlm.DeployPlan,
    per_host: dict[str, dict[str, Any]],
    error: str | None,
    actor: str,
    log_text: str = "",
    hold: set[str] | None = None,
) -> None:
    """The deploy's per-host results; members deployed become ready (but those in ``hold``: zero-touch
    nodes wait for their own verification job)."""
    hosts = [h.name for h in p.hosts]
    if error and not per_host:  # nothing ran: say so for every host
        per_host = {h: {"status": "skipped", "error": error} for h in hosts}
    with session_scope(engine) as s:
        op = op_svc.get(s, op_id)
        summary = f"changed={sum(int(r.get('changed', 0)) for r in per_host.values())}\n"
        op_svc.add_results(s, op, per_host, log_text + (f"error: {error}\n" if error else "") + summary)
        failed = {n: str(r.get("error") or r["status"]) for n, r in per_host.items() if r["status"] != "ok"}
        ok_nodes = [n for n in p.members if n not in failed and n not in (hold or ())]
        svc.finish_deploy(s, name, ok_nodes=ok_nodes, failed=failed, error=error, actor=actor)


def _finish_op(engine: Engine, op_id: int, error: str | None) -> None:
    with session_scope(engine) as s:
        op_svc.finish(s, op_svc.get(s, op_id), error)


def _store_states(engine: Engine, name: str, states: dict[str, str]) -> None:
    with session_scope(engine) as s:
        svc.apply_states(s, name, states)


# ---- verify ----------------------------------------------------------------------------------------


async def _settle_states(
    manager: wlm.WorkloadManager,
    ssh: SshClient,
    target: Target,
    engine: Engine,
    name: str,
    members: list[str],
) -> None:
    """The members' states once the verification job has let go of them (bounded by SETTLE_S), stored:
    a periodic sync that ran during the job saw them allocated, and the next may be half a minute away."""

    def settled(states: dict[str, wlm.WlmNodeState]) -> bool:  # {}: the controller did not answer yet
        return bool(states) and not any(
            (st := states.get(n)) is not None and any(b in st.state for b in BUSY) for n in members
        )

    try:
        states = await wlm.poll_states(manager, ssh, target, settled, SETTLE_S)
    except BcmError as exc:
        log.info("wlm %s: states after the verification job not read: %s", name, exc.message)
        return
    if not states:  # the controller never answered: the stored states stay as the last sync saw them
        log.info("wlm %s: states after the verification job not read: the controller did not answer", name)
        return
    await anyio.to_thread.run_sync(_store_states, engine, name, {k: v.state for k, v in states.items()})


async def start_verify(runner: Starter, name: str | None, actor: str) -> WlmStarted:
    """A verification job on a deployed cluster (no node locks: it only submits a job)."""
    op_id = await runner.submit("wlm.verify", [], actor, None, extra=name)

    def picked() -> str:
        with session_scope(runner.engine) as s:
            return str((op_svc.get(s, op_id).spec or {})["cluster"])

    return WlmStarted(cluster=await anyio.to_thread.run_sync(picked), operation_id=op_id)


def _verify_setup(s: Session, op: Operation, name: Any) -> None:
    row = svc.pick(s, name)
    if row.state not in (WlmState.DEPLOYED, WlmState.PARTIAL):
        raise Conflict(f"cluster {row.name} is {row.state}: deploy it before verifying")
    members = svc.member_names(s, row)
    op.targets, op.progress_total = fold_hostlist(members), len(members)
    op.spec = {"cluster": row.name}
    row.last_verify_op = op.id
    s.add(row)


async def _verify_run(job: Job) -> None:
    def begin() -> None:
        with session_scope(job.engine) as s:
            op_svc.start(s, op_svc.get(s, job.op_id))

    await anyio.to_thread.run_sync(begin)
    await _verify(job, job.op_id, job.spec["cluster"], job.actor, record_on_op=True)


# a verification job is not taken up again: its verdict would mix two runs
VERIFY = Handler(
    _verify_run, timeout=lambda _s, _n: VERIFY_TIMEOUT_S + 120, setup=_verify_setup, resumable=False
)


async def _verify(runner: Job, op_id: int, name: str, actor: str, *, record_on_op: bool) -> wlm.VerifyResult:
    """The verification job; results go on a verify operation, or into the deploy operation's log."""
    engine, settings = runner.engine, runner.settings

    def load() -> tuple[list[str], bool]:
        with session_scope(engine) as s:
            nodes = svc.members(s, svc.get(s, name))
            with_gpus = svc.nodes_with_gpus(s, [n.id for n in nodes if n.id is not None])
            return [n.name for n in nodes], bool(with_gpus)

    members, gpus = await anyio.to_thread.run_sync(load)
    manager, target = await anyio.to_thread.run_sync(_controller, engine, settings, name)
    client = _ssh(settings)
    try:
        result = await manager.verify(client, target, members, timeout_s=VERIFY_TIMEOUT_S, gpus=gpus)
    except DriverError as exc:
        result = wlm.VerifyResult(False, exc.message)
    await _settle_states(manager, client, target, engine, name, members)
    detail = {
        "ok": result.ok,
        "message": result.message,
        "job_id": result.job_id,
        "alloc_tres": result.alloc_tres,
        "nodes": result.nodes,
        "op": op_id,
    }

    def record() -> None:
        with session_scope(engine) as s:
            svc.record_verify(s, name, op_id, result.ok, detail)
            op = op_svc.get(s, op_id)
            line = f"verify: {'passed' if result.ok else 'FAILED'}: {result.message}"
            line += f" (job {result.job_id}, AllocTRES {result.alloc_tres})\n" if result.job_id else "\n"
            if record_on_op:
                status = "ok" if result.ok else "failed"  # all or nothing: one verdict for every node
                per_node = {
                    n: {
                        "status": status,
                        "cuda_visible_devices": result.nodes.get(n),
                        **({} if result.ok else {"error": result.message}),
                    }
                    for n in members
                }
                op_svc.add_results(s, op, per_node, line + result.output[-2000:] + "\n")
                op_svc.finish(s, op, None if result.ok else result.message)
            else:
                op.log = (op.log + line)[-op_svc.MAX_LOG_CHARS :]
                s.add(op)
            events.record(
                s,
                actor,
                "wlm.verify",
                name,
                line.strip(),
                severity="info" if result.ok else "error",
                detail=detail,
            )

    await anyio.to_thread.run_sync(record)
    return result


# ---- drain / resume / sync ---------------------------------------------------------------------------


async def drain(
    engine: Engine, settings: Settings, names: list[str], reason: str | None, actor: str
) -> list[dict[str, Any]]:
    """Drain in each owning cluster (Slurm: ``State=DRAIN Reason="bcm: …"``); 409 if a node has no cluster."""
    return await _node_action(engine, settings, names, actor, "drain", reason)


async def resume(engine: Engine, settings: Settings, names: list[str], actor: str) -> list[dict[str, Any]]:
    return await _node_action(engine, settings, names, actor, "resume", None)


async def _node_action(
    engine: Engine, settings: Settings, names: list[str], actor: str, action: str, reason: str | None
) -> list[dict[str, Any]]:
    def owners() -> dict[str, list[str]]:
        with session_scope(engine) as s:
            node_svc.get_many(s, names)
            return svc.clusters_of(s, names)

    by_cluster = await anyio.to_thread.run_sync(owners)
    ssh = _ssh(settings)
    out: list[dict[str, Any]] = []
    for cluster, members in by_cluster.items():
        manager, target = await anyio.to_thread.run_sync(_controller, engine, settings, cluster)
        if action == "drain":
            await manager.drain(ssh, target, members, reason)
            states = await manager.node_states(ssh, target)
        else:
            await manager.resume(ssh, target, members)
            # the controller pings a resumed node before it counts as responding again (``idle*`` meanwhile)
            states = await manager.wait_registered(ssh, target, members, timeout_s=RESUME_WAIT_S)

        def record(
            cluster: str = cluster,
            members: list[str] = members,
            states: dict[str, Any] = states,
            manager: wlm.WorkloadManager = manager,
        ) -> None:
            with session_scope(engine) as s:
                svc.apply_states(s, cluster, {k: v.state for k, v in states.items()})
                message = manager.drain_reason(reason) if action == "drain" else ""
                events.record(s, actor, f"wlm.{action}", fold_hostlist(members), message)

        await anyio.to_thread.run_sync(record)
        for n in members:
            st = states.get(n)
            out.append(
                {
                    "name": n,
                    "status": "ok",
                    "cluster": cluster,
                    "wlm_state": st.state if st else None,
                    "reason": st.reason if st else None,
                }
            )
    return out


async def sync_cluster(engine: Engine, settings: Settings, name: str) -> dict[str, str]:
    """Copy the workload manager's node states into the database now, then who runs on which node (the
    tenants' sample: :mod:`bcm.services.wlm_usage`); returns the states. A failed usage read keeps the
    last sample (its ``usage_at`` says how old it is) and never fails the states."""
    manager, target = await anyio.to_thread.run_sync(_controller, engine, settings, name)
    ssh = _ssh(settings)
    states = {k: v.state for k, v in (await manager.node_states(ssh, target)).items()}
    await anyio.to_thread.run_sync(_store_states, engine, name, states)
    try:
        usage = await manager.node_usage(ssh, target)
    except BcmError as exc:
        log.warning("wlm sync of %s: running work not read: %s", name, exc.message)
        return states
    await anyio.to_thread.run_sync(_store_usage, engine, name, usage)
    return states


def _store_usage(engine: Engine, name: str, usage: list[wlm.NodeUsage]) -> None:
    with session_scope(engine) as s:
        wlm_usage.apply(s, name, usage)


def _deployed(engine: Engine) -> list[str]:
    """The clusters a pass syncs; the others' tenants samples go (nothing reads their workload manager)."""
    with session_scope(engine) as s:
        names = [r.name for r in svc.query(s) if r.state in (WlmState.DEPLOYED, WlmState.PARTIAL)]
        wlm_usage.keep_only(s, names)
        return names


async def sync_all(engine: Engine, settings: Settings) -> None:
    """One pass: sync each deployed cluster. One cluster's failure never stops the others; a database
    failure ends the pass (the server's supervisor, :func:`bcm.workers.supervise.supervise`, retries it)."""
    for name in await anyio.to_thread.run_sync(_deployed, engine):
        try:
            await sync_cluster(engine, settings, name)
        except BcmError as exc:
            log.warning("wlm sync of %s failed: %s", name, exc.message)
        except Exception:
            log.exception("wlm sync of %s failed", name)


async def loop(
    engine: Engine,
    settings: Settings,
    interval_s: float = SYNC_INTERVAL_S,
    *,
    stop: Callable[[], bool] = lambda: False,
) -> None:
    """Passes of :func:`sync_all` every ``interval_s`` until ``stop()`` (tests; the server supervises them)."""
    while not stop():
        await sync_all(engine, settings)
        await asyncio.sleep(interval_s)
