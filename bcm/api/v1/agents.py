"""/api/v1/agents/deploy and /api/v1/nodes/{name}/token: put the health agent on nodes, give them tokens."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Request, status
from pydantic import BaseModel, Field

from bcm.api.deps import Admin, SessionDep, actor
from bcm.api.params import Name
from bcm.db import session_scope
from bcm.domain.naming import expand_hostlist, fold_hostlist
from bcm.errors import InvalidInput
from bcm.services import agents as svc
from bcm.services import nodes as node_svc
from bcm.services import operations as op_svc

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
    engine = request.app.state.engine
    url = body.server_url or settings.pxe.server_url
    if not url:
        raise InvalidInput(
            "server_url: say which URL the nodes reach bcm at (or set BCM_PXE__SERVER_URL)",
            field="server_url",
        )
    spec = svc.DeploySpec(url, body.interval_s or settings.health.interval_s, body.nvml_fixture)
    svc.check_spec(spec)
    names = expand_hostlist(body.nodes, "nodes")
    who = actor(token)

    def create() -> int:
        with session_scope(engine) as s:
            node_svc.get_many(s, names)  # NotFound names every unknown node
            op = op_svc.create(s, "agent_deploy", fold_hostlist(names), len(names), who)
            assert op.id is not None
            return op.id

    op_id = await asyncio.to_thread(create)
    task = asyncio.create_task(_run(engine, settings, op_id, names, spec, who))
    runner = getattr(request.app.state, "runner", None)
    if runner is not None:  # tracked so that shutdown cancels it
        runner.tasks.add(task)
        task.add_done_callback(runner.tasks.discard)
    return AgentDeployStarted(operation_id=op_id, nodes=names)


async def _run(
    engine: Any, settings: Any, op_id: int, names: list[str], spec: svc.DeploySpec, who: str
) -> None:
    try:
        await svc.deploy(engine, settings, op_id, names, spec, who)
    except Exception as exc:  # a job bug must still close its operation
        error = f"{type(exc).__name__}: {exc}"

        def fail() -> None:
            with session_scope(engine) as s:
                op = op_svc.get(s, op_id)
                if not op_svc.is_finished(op):
                    op_svc.finish(s, op, error)

        await asyncio.to_thread(fail)
        logging.getLogger("bcm.agents").exception("agent deploy %s failed", op_id)
