"""The verb table: every long verb's handler, and how a node verb is done.

One place maps an operation's kind to its :class:`~bcm.workers.job.Handler` (``HANDLERS``); the
runner looks kinds up here and knows none of them. Node verbs (``POST /nodes/actions/{verb}``) are
done one of three ways, decided here alone: a lifecycle verb with a handler (``inventory``) becomes
an operation; ``provision``/``reimage`` are queued for the provisioner (which starts its own
``provision`` operations); the others are applied at once in one transaction, ``drain``/``resume``
in the node's workload manager first.
"""

from __future__ import annotations

from typing import Any

import anyio
from sqlmodel import Session

from bcm.db import session_scope
from bcm.domain.power import PowerAction
from bcm.models.node import VerbResult
from bcm.models.operation import Operation
from bcm.services import agents as agent_svc
from bcm.services import health as health_svc
from bcm.services import nodes as node_svc
from bcm.services import wlm as wlm_svc
from bcm.workers import image_push, images, inventory, power, provision, tenancy, wlm
from bcm.workers.job import Handler, Job, Starter


def _agents_setup(s: Session, op: Operation, names: Any) -> None:
    node_svc.get_many(s, list(names or []))  # NotFound names every unknown node; nothing is created then


async def _agents_run(job: Job) -> None:
    spec = agent_svc.DeploySpec(job.spec["server_url"], job.spec["interval_s"], job.spec.get("nvml_fixture"))
    await agent_svc.deploy(job.engine, job.settings, job.op_id, job.names, spec, job.actor)


HANDLERS: dict[str, Handler] = {
    "inventory": inventory.HANDLER,
    **{f"power-{a.value}": power.handler(a) for a in PowerAction},
    "provision": provision.PXE_STEP,
    "image-build": images.HANDLER,
    "image-push": image_push.HANDLER,
    "wlm.deploy": wlm.DEPLOY,
    "wlm.verify": wlm.VERIFY,
    "agent_deploy": Handler(_agents_run, setup=_agents_setup),
    "tenancy.apply": tenancy.APPLY,
}


async def node_verb(
    runner: Starter, verb: str, names: list[str], actor: str, reason: str | None, *, rekey: bool = False
) -> VerbResult:
    if verb in ("provision", "reimage"):
        return await provision.provision_verb(runner, verb, names, actor, reason, rekey)
    handler = HANDLERS.get(verb)
    if handler is not None and handler.moves_state:
        op_id = await runner.submit(verb, names, actor, reason)
        return VerbResult(
            verb=verb, nodes=[{"name": n, "status": "started"} for n in names], operation_id=op_id
        )
    if verb in ("drain", "resume"):
        await _through_workload_manager(runner, verb, names, actor, reason)
    moved = await anyio.to_thread.run_sync(_apply, runner, verb, names, actor, reason)
    return VerbResult(verb=verb, nodes=moved)


async def _through_workload_manager(
    runner: Starter, verb: str, names: list[str], actor: str, reason: str | None
) -> None:
    """Nodes in a deployed cluster are drained/resumed in its workload manager first (with a reason
    marked as bcm's: ``bcm: …`` in Slurm). Legality is checked before the workload manager is touched;
    if it fails, bcm's own state is left as it was."""

    def members() -> list[str]:
        with session_scope(runner.engine) as s:
            node_svc.check_verb(s, names, verb)
            return wlm_svc.wlm_members(s, names)

    in_wlm = await anyio.to_thread.run_sync(members)
    if not in_wlm:
        return
    if verb == "drain":
        await wlm.drain(runner.engine, runner.settings, in_wlm, reason or "drained by an admin", actor)
    else:
        await wlm.resume(runner.engine, runner.settings, in_wlm, actor)


def _apply(
    runner: Starter, verb: str, names: list[str], actor: str, reason: str | None
) -> list[dict[str, Any]]:
    with session_scope(runner.engine) as s:
        nodes = node_svc.apply_verb(s, names, verb, actor, reason)
        if verb in ("drain", "resume") and actor != health_svc.ACTOR:
            # an admin's own drain or resume takes over from bcm's (it will not undo or redo it)
            health_svc.note_admin_verb(s, [n.id for n in nodes if n.id is not None], verb)
        return [{"name": n.name, "status": "ok", "state": n.provision_state} for n in nodes]
