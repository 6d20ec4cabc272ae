"""/api/v1/nodes/actions/power-*: power operations through BMCs; BMC passwords (write-only), TLS pins,
plain-http permission. Everything that decides where a password may go is admin only."""

from __future__ import annotations

import ipaddress
from typing import Any

from fastapi import APIRouter, Request
from pydantic import StrictBool, field_validator
from sqlmodel import Field, SQLModel

from bcm.api.deps import Admin, Operator, SessionDep, actor
from bcm.api.params import Name, Verb
from bcm.domain.naming import expand_hostlist
from bcm.domain.power import PowerAction
from bcm.errors import InvalidInput
from bcm.models.node import VerbRequest, VerbResult
from bcm.services import power as svc
from bcm.workers import power as worker

router = APIRouter(tags=["power"])


class PasswordRequest(SQLModel):
    nodes: str = Field(max_length=65535)
    password: str = Field(min_length=1, max_length=128, repr=False)


class CategoryPasswordRequest(SQLModel):
    password: str = Field(min_length=1, max_length=128, repr=False)
    # zero-touch: the network whose BMCs, as discoveries report them, get this password too (None: none)
    discover_range: str | None = Field(default=None, max_length=64)

    @field_validator("discover_range")
    @classmethod
    def _range(cls, v: str | None) -> str | None:
        if v is None:
            return None
        try:
            net = ipaddress.ip_network(v.strip(), strict=False)
        except ValueError:
            raise InvalidInput(
                f"discover_range: {v[:64]!r} is not a network (like 198.18.0.192/26)", field="discover_range"
            ) from None
        if net.num_addresses > 65536:
            raise InvalidInput(
                f"discover_range: {net} holds more than 65536 addresses; name the BMC network",
                field="discover_range",
            )
        return str(net)


class NodesRequest(SQLModel):
    nodes: str = Field(max_length=65535)


class AllowHttpRequest(SQLModel):
    allow: StrictBool  # true or false, not 1 or "yes": it decides where passwords travel in clear


@router.post("/nodes/actions/power-{action}", response_model=VerbResult)
async def power_action(action: Verb, body: VerbRequest, request: Request, token: Operator) -> VerbResult:
    """Start a power operation (status, on, off, soft-off, cycle, pxe) on a hostlist of nodes."""
    try:
        what = PowerAction(action)
    except ValueError:
        choices = ", ".join(a.value for a in PowerAction)
        raise InvalidInput(
            f"action: unknown power action {action!r} (one of {choices})", field="action"
        ) from None
    names = expand_hostlist(body.nodes, "nodes")
    op_id = await worker.start(request.app.state.runner, what, names, actor(token), body.reason)
    return VerbResult(
        verb=f"power-{what.value}",
        nodes=[{"name": n, "status": "started"} for n in names],
        operation_id=op_id,
    )


@router.put("/nodes/bmc-password")
def set_node_password(
    body: PasswordRequest, request: Request, session: SessionDep, token: Admin
) -> dict[str, Any]:
    """Store the BMC password of nodes, encrypted; it is never returned."""
    names = expand_hostlist(body.nodes, "nodes")
    count = svc.set_node_password(
        session, request.app.state.settings.state_dir, names, body.password, actor(token)
    )
    return {"updated": count}


@router.put("/categories/{name}/bmc-password")
def set_category_password(
    body: CategoryPasswordRequest,
    request: Request,
    session: SessionDep,
    token: Admin,
    name: Name,
) -> dict[str, Any]:
    """Store the BMC password a category's nodes inherit, encrypted; it is never returned."""
    svc.set_category_password(
        session,
        request.app.state.settings.state_dir,
        name,
        body.password,
        actor(token),
        discover_range=body.discover_range,
    )
    return {"updated": 1}


@router.put("/categories/{name}/bmc-allow-http")
def set_category_http(
    body: AllowHttpRequest, session: SessionDep, token: Admin, name: Name
) -> dict[str, Any]:
    """Allow (or forbid) the category's nodes to reach Redfish BMCs over plain http (passwords in clear)."""
    svc.set_category_http(session, name, body.allow, actor(token))
    return {"updated": 1, "bmc_allow_http": body.allow}


@router.post("/nodes/bmc-unpin")
def unpin(body: NodesRequest, session: SessionDep, token: Admin) -> dict[str, Any]:
    """Forget the nodes' pinned BMC certificates (replaced certificates); the next contact pins anew."""
    return {"updated": svc.clear_tls_pins(session, expand_hostlist(body.nodes, "nodes"), actor(token))}
