"""/api/v1/wlm: workload-manager clusters: deploy (one route per kind), status, verify, sync, drain and
resume nodes. Past the deploy route, nothing here names a kind: the cluster's own kind decides."""

from __future__ import annotations

import shutil
from typing import Any

from fastapi import APIRouter, Request, status

from bcm.api.deps import Operator, SessionDep, Viewer, actor
from bcm.api.params import ClusterName
from bcm.domain.naming import expand_hostlist
from bcm.models.wlm import (
    KubernetesDeployRequest,
    SlurmDeployRequest,
    WlmClusterDetail,
    WlmClusterPublic,
    WlmKind,
    WlmNodeRequest,
    WlmStarted,
)
from bcm.services import wlm as svc
from bcm.workers import wlm as jobs

router = APIRouter(prefix="/wlm", tags=["wlm"])


@router.post("/slurm/deploy", response_model=WlmStarted, status_code=status.HTTP_202_ACCEPTED)
async def deploy_slurm(body: SlurmDeployRequest, request: Request, token: Operator) -> WlmStarted:
    return await jobs.start_deploy(request.app.state.runner, WlmKind.SLURM.value, body, actor(token))


@router.post("/kubernetes/deploy", response_model=WlmStarted, status_code=status.HTTP_202_ACCEPTED)
async def deploy_kubernetes(body: KubernetesDeployRequest, request: Request, token: Operator) -> WlmStarted:
    """Control plane on ``controller``, kubelets on ``nodes`` (``settings.mode``: kubeadm or lab)."""
    return await jobs.start_deploy(request.app.state.runner, WlmKind.KUBERNETES.value, body, actor(token))


@router.get("", response_model=list[WlmClusterPublic])
def list_clusters(session: SessionDep, _t: Viewer) -> list[WlmClusterPublic]:
    return [svc.to_public(session, row) for row in svc.query(session)]


@router.post("/actions/drain")
async def drain_nodes(body: WlmNodeRequest, request: Request, token: Operator) -> dict[str, Any]:
    app = request.app
    nodes = await jobs.drain(
        app.state.engine, app.state.settings, expand_hostlist(body.nodes), body.reason, actor(token)
    )
    return {"verb": "drain", "nodes": nodes}


@router.post("/actions/resume")
async def resume_nodes(body: WlmNodeRequest, request: Request, token: Operator) -> dict[str, Any]:
    app = request.app
    nodes = await jobs.resume(app.state.engine, app.state.settings, expand_hostlist(body.nodes), actor(token))
    return {"verb": "resume", "nodes": nodes}


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT)
def remove_cluster(name: ClusterName, session: SessionDep, request: Request, token: Operator) -> None:
    """Forget the cluster (nodes stay registered; nothing on them is stopped); 409 while it deploys."""
    svc.remove(session, name, actor(token))
    session.commit()
    shutil.rmtree(svc.secrets_dir(request.app.state.settings.state_dir, name), ignore_errors=True)


@router.get("/{name}", response_model=WlmClusterDetail)
def get_cluster(name: ClusterName, session: SessionDep, _t: Viewer) -> WlmClusterPublic:
    return svc.to_public(session, svc.get(session, name), detail=True)


@router.post("/{name}/verify", response_model=WlmStarted, status_code=status.HTTP_202_ACCEPTED)
async def verify(name: ClusterName, request: Request, token: Operator) -> WlmStarted:
    return await jobs.start_verify(request.app.state.runner, name, actor(token))


@router.post("/{name}/sync")
async def sync(name: ClusterName, request: Request, _t: Operator) -> dict[str, Any]:
    app = request.app
    return {"cluster": name, "states": await jobs.sync_cluster(app.state.engine, app.state.settings, name)}
