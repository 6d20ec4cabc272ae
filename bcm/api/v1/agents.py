"""/api/v1/agents/deploy and /api/v1/nodes/{name}/token: put the health agent on nodes, give them tokens."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, status
from pydantic import BaseModel, Field

from bcm.api.deps import Admin, SessionDep, actor
from bcm.api.params import Name
from bcm.domain.naming import expand_hostlist
from bcm.errors import InvalidInput
from bcm.services import agents as svc
from bcm.services import tls
from bcm.workers.runner import Runner

router = APIRouter(tags=["agents"])


class NodeTokenCreated(BaseModel):
    node: str
    prefix: str
    token: str  # shown once


class AgentDeployRequest(BaseModel):
    nodes: str = Field(max_length=65535)
    server_url: str | None = Field(default=None, max_length=512, description="URL nodes use to reach bcm")
    interval_s: float | None = Field(default=None, gt=0, le=86400)
    nvml_fixture: dict[str, Any] | None = Field(default=None, description="lab only: a fake NVML fixture")


class AgentDeployStarted(BaseModel):
    operation_id: int
    nodes: list[str]


@router.post("/nodes/{name}/token", response_model=NodeTokenCreated, status_code=status.HTTP_201_CREATED)
def node_token(name: Name, session: SessionDep, token: Admin) -> NodeTokenCreated:
    """A fresh agent token for the node; the old one stops working at once."""
    row, secret = svc.issue_node_token(session, name, actor(token))
    return NodeTokenCreated(node=name, prefix=row.prefix, token=secret)


@router.post("/agents/deploy", response_model=AgentDeployStarted, status_code=status.HTTP_202_ACCEPTED)
async def deploy_agents(body: AgentDeployRequest, request: Request, token: Admin) -> AgentDeployStarted:
    settings = request.app.state.settings
    # with TLS on, agents report over https (verified against bcm's CA, pushed with the agent)
    url = body.server_url or tls.node_api_url(settings) or settings.pxe.server_url
    if not url:
        raise InvalidInput(
            "server_url: say which URL the nodes reach bcm at (or set BCM_PXE__SERVER_URL)",
            field="server_url",
        )
    if settings.tls.enabled and not url.startswith("https://"):
        raise InvalidInput(
            "server_url: the API speaks TLS here; agents report to an https:// URL", field="server_url"
        )
    spec = svc.DeploySpec(url, body.interval_s or settings.health.interval_s, body.nvml_fixture)
    svc.check_spec(spec)
    names = expand_hostlist(body.nodes, "nodes")
    who = actor(token)

    # an agent_deploy operation (bcm.workers.verbs): row, lease and node locks in one transaction
    runner: Runner = request.app.state.runner
    job_spec = {
        "server_url": spec.server_url,
        "interval_s": spec.interval_s,
        "nvml_fixture": spec.nvml_fixture,
    }
    op_id = await runner.submit("agent_deploy", names, who, None, spec=job_spec, extra=names)
    return AgentDeployStarted(operation_id=op_id, nodes=names)
