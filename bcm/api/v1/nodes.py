"""/api/v1/nodes: register, query, update, remove nodes and send them verbs."""

from __future__ import annotations

from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Query, Request, status
from sqlmodel import Field, Session, SQLModel

from bcm.api.deps import Admin, Operator, SessionDep, Viewer, actor
from bcm.api.params import HOSTLIST_PATTERN, HostlistQuery, Name, Offset, Verb, text_query
from bcm.domain.naming import expand_hostlist
from bcm.errors import InvalidInput
from bcm.models.auth import Role
from bcm.models.node import (
    NodeBulkCreate,
    NodeCreate,
    NodeInstallUpdate,
    NodePage,
    NodePublic,
    NodeUpdate,
    RekeyRequest,
    VerbRequest,
    VerbResult,
)
from bcm.services import auth, trust
from bcm.services import nodes as svc
from bcm.workers import verbs

router = APIRouter(prefix="/nodes", tags=["nodes"])
NamePath = Name


@router.get("", response_model=NodePage)
def list_nodes(
    session: SessionDep,
    _t: Viewer,
    state: Annotated[str | None, text_query(16)] = None,
    category: Annotated[str | None, text_query(63)] = None,
    nodes: HostlistQuery = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Offset = 0,
) -> NodePage:
    rows, total = svc.query(
        session, state=state, category=category, hostlist=nodes, limit=limit, offset=offset
    )
    return NodePage(items=svc.to_public(session, rows), total=total, limit=limit, offset=offset)


@router.post("", response_model=NodePublic, status_code=status.HTTP_201_CREATED)
def create_node(spec: NodeCreate, session: SessionDep, token: Operator) -> NodePublic:
    node = svc.create(session, spec, actor(token))
    return svc.to_public(session, [node])[0]


@router.post("/bulk", response_model=list[NodePublic], status_code=status.HTTP_201_CREATED)
def bulk_create(spec: NodeBulkCreate, session: SessionDep, token: Operator) -> list[NodePublic]:
    return svc.bulk_create(session, spec, actor(token))


@router.delete("")
def delete_nodes(
    session: SessionDep,
    token: Admin,
    nodes: Annotated[
        str, Query(min_length=1, max_length=8192, pattern=HOSTLIST_PATTERN, description="hostlist")
    ],
) -> dict[str, Any]:
    names = svc.delete(session, expand_hostlist(nodes), actor(token))
    return {"deleted": names}


@router.post("/actions/{verb}", response_model=VerbResult)
async def node_verb(verb: Verb, body: VerbRequest, request: Request, token: Operator) -> VerbResult:
    runner = request.app.state.runner
    if body.rekey:  # a pinned host key changes only at an admin's request (#26)
        if verb not in ("provision", "reimage"):
            raise InvalidInput("rekey: only provision and reimage make new host keys", field="rekey")
        auth.require_role(token, Role.ADMIN)
    return await verbs.node_verb(
        runner, verb, expand_hostlist(body.nodes), actor(token), body.reason, rekey=body.rekey
    )


class TrustRequest(SQLModel):
    nodes: str = Field(max_length=65535)
    password: str = Field(min_length=1, max_length=1024, repr=False)


@router.post("/trust")
async def trust_nodes(body: TrustRequest, request: Request, token: Admin) -> dict[str, Any]:
    """Install the server's SSH key on nodes using a one-time root password (never stored)."""
    names = expand_hostlist(body.nodes)
    app = request.app
    await anyio.to_thread.run_sync(_known, app.state.engine, names)
    results = await trust.trust(app.state.engine, app.state.settings, names, body.password, actor(token))
    return {"nodes": results}


def _known(engine: Any, names: list[str]) -> None:
    with Session(engine) as s:
        svc.get_many(s, names)


@router.get("/{name}", response_model=NodePublic)
def get_node(name: NamePath, session: SessionDep, _t: Viewer) -> NodePublic:
    return svc.to_public(session, [svc.get(session, name)])[0]


@router.get("/{name}/hardware")
def get_hardware(name: NamePath, session: SessionDep, _t: Viewer) -> dict[str, Any]:
    return svc.hardware(session, name)


@router.patch("/{name}", response_model=NodePublic)
def update_node(name: NamePath, spec: NodeUpdate, session: SessionDep, token: Operator) -> NodePublic:
    node = svc.update_node(session, name, spec, actor(token))
    return svc.to_public(session, [node])[0]


@router.put("/{name}/install", response_model=NodePublic)
def set_install(name: NamePath, body: NodeInstallUpdate, session: SessionDep, token: Operator) -> NodePublic:
    """The node's install mode (null: its category's), one boot's mode, and whether it is a data node (#30).
    A change that makes a data node's next boot wipe its disks is a 409 unless an admin sends confirm_wipe."""
    from bcm.services import install

    node = install.set_node(session, name, body, actor(token), auth.has_role(token, Role.ADMIN))
    return svc.to_public(session, [node])[0]


@router.post("/{name}/rekey", response_model=NodePublic)
def rekey_node(name: NamePath, body: RekeyRequest, session: SessionDep, token: Admin) -> NodePublic:
    """Replace the node's pinned SSH host key, or clear it so the next contact pins anew (audited)."""
    node = svc.rekey(session, name, body.ssh_host_key, actor(token))
    return svc.to_public(session, [node])[0]


@router.delete("/{name}")
def delete_node(name: NamePath, session: SessionDep, token: Admin) -> dict[str, Any]:
    return {"deleted": svc.delete(session, [name], actor(token))}
