"""Zero-touch join: booted nodes whose category names a workload-manager cluster join it, verified.

Each round (the leader's work): the nodes that are booted, inventoried, unlocked and in no cluster, whose
category names a cluster (``wlm_cluster``) that is deployed, are added to it by one deploy of that cluster
(Ansible's roles are idempotent: members already there stay as they are; slurm.conf and gres.conf are
rendered again from the inventory, with the new nodes' GRES, and Slurm is reconfigured). A batch waits while
other nodes of those categories still provision or await their first inventory, for at most ``HOLD_S`` after
its first node could join: a rack powered on together makes one deploy, and a node that never boots delays
nobody for long. Each joining node then runs its own one-node verification job: pass → ``ready``; fail →
``failed`` with the job's output in ``last_error`` (bcm.workers.wlm).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
from sqlalchemy.engine import Engine

from bcm.db import session_scope
from bcm.domain import kubernetes as k8s
from bcm.domain.naming import fold_hostlist
from bcm.errors import BcmError
from bcm.models.wlm import KubernetesDeployRequest, SlurmDeployRequest, WlmDeployRequest
from bcm.services import events
from bcm.services import wlm as svc
from bcm.settings import Settings
from bcm.workers import wlm as wlm_worker

log = logging.getLogger("bcm.autojoin")
ACTOR = "bcm:zero-touch"
TICK_S = 5.0
HOLD_S = 180.0  # a batch waits this long at most for the rest of its rack
RETRY_S = 60.0  # after a join deploy started, the cluster's next one waits at least this long


def request(plan: svc.JoinPlan) -> WlmDeployRequest:
    """The deploy that adds ``plan.joining`` to the cluster as it is (its settings and members kept) and
    leaves ``plan.leaving`` out; a change that only removes nodes verifies nothing."""
    nodes = fold_hostlist(plan.nodes())
    verify = bool(plan.joining)
    if plan.kind == "kubernetes":
        return KubernetesDeployRequest(
            name=plan.cluster,
            controller=plan.controller,
            nodes=nodes,
            verify=verify,
            settings=k8s.KubernetesSettings.model_validate(plan.settings),
        )
    from bcm.domain.slurm import SlurmSettings

    return SlurmDeployRequest(
        name=plan.cluster,
        controller=plan.controller,
        nodes=nodes,
        verify=verify,
        settings=SlurmSettings.model_validate(plan.settings),
    )


class AutoJoin:
    def __init__(self, engine: Engine, settings: Settings, runner: Any, clock: Any = time.monotonic) -> None:
        self.engine, self.settings, self.runner, self.clock = engine, settings, runner, clock
        self.first_seen: dict[str, float] = {}  # node -> when it could first join
        self.next_try: dict[str, float] = {}  # cluster -> not before
        self.told: set[str] = set()  # clusters whose trouble was logged (once per streak)

    async def tick(self) -> list[int]:
        """One round; returns the operations it started."""

        def plans() -> list[svc.JoinPlan]:
            with session_scope(self.engine) as s:
                return svc.join_plans(s)

        now = self.clock()
        started: list[int] = []
        found = await anyio.to_thread.run_sync(plans)
        seen = {n for p in found for n in p.joining}
        self.first_seen = {n: self.first_seen.get(n, now) for n in seen}
        for plan in found:
            if plan.missing:
                if plan.cluster not in self.told:
                    self.told.add(plan.cluster)
                    log.warning(
                        "zero-touch: %s wait to join %s: %s",
                        fold_hostlist(plan.joining),
                        plan.cluster,
                        plan.missing,
                    )
                    await anyio.to_thread.run_sync(self._event, plan, f"wait to join: {plan.missing}")
                continue
            self.told.discard(plan.cluster)
            if now < self.next_try.get(plan.cluster, 0.0):
                continue
            if plan.joining:
                oldest = min(self.first_seen[n] for n in plan.joining)
                if plan.pending and now - oldest < HOLD_S:
                    continue  # the rest of the rack is still booting
            if not plan.nodes():
                if plan.cluster not in self.told:
                    self.told.add(plan.cluster)
                    log.warning(
                        "zero-touch: %s leave %s, which would have no node left: not deployed",
                        fold_hostlist(list(plan.leaving)),
                        plan.cluster,
                    )
                continue
            try:
                req = request(plan)
                started_op = await wlm_worker.start_deploy(
                    self.runner, plan.kind, req, ACTOR, joining=plan.joining or None
                )
            except BcmError as exc:  # locked, deploying: the next round tries again
                log.info(
                    "zero-touch: %s join %s later: %s", fold_hostlist(plan.joining), plan.cluster, exc.message
                )
                self.next_try[plan.cluster] = now + TICK_S * 2
                continue
            self.next_try[plan.cluster] = now + RETRY_S
            started.append(started_op.operation_id)
            log.info(
                "zero-touch: %s join %s, %s leave (operation %s)",
                fold_hostlist(plan.joining) or "none",
                plan.cluster,
                fold_hostlist(list(plan.leaving)) or "none",
                started_op.operation_id,
            )
        return started

    def _event(self, plan: svc.JoinPlan, message: str) -> None:
        with session_scope(self.engine) as s:
            events.record(s, ACTOR, "node.join", fold_hostlist(plan.joining), message, severity="warning")
