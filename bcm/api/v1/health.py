"""/api/v1/health…: GPU health summary, nodes by verdict, events; a node's GPUs; a GPU's history."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request

from bcm.api.deps import SessionDep, Viewer
from bcm.api.params import PRINTABLE_PATTERN, HostlistQuery, Name, Offset, Since, text_query
from bcm.models.health import (
    GpuHealthPublic,
    GpuHistory,
    HealthEventPublic,
    HealthSummary,
    NodeHealthPage,
)
from bcm.services import health_queries as q

router = APIRouter(tags=["health"])
# OK, UNKNOWN, WARN or FAIL in any ASCII case (JSON Schema patterns have no case-insensitive flag)
VERDICT_PATTERN = (
    "^(" + "|".join("".join(f"[{c}{c.lower()}]" for c in v) for v in ("OK", "UNKNOWN", "WARN", "FAIL")) + ")$"
)
Hostlist = HostlistQuery


@router.get("/health", response_model=HealthSummary)
def health_summary(session: SessionDep, _t: Viewer, request: Request) -> HealthSummary:
    return q.summary(session, request.app.state.settings.health)


@router.get("/health/nodes", response_model=NodeHealthPage)
def health_nodes(
    session: SessionDep,
    _t: Viewer,
    request: Request,
    verdict: Annotated[
        str | None, Query(max_length=16, pattern=VERDICT_PATTERN, description="ok, unknown, warn or fail")
    ] = None,
    nodes: Hostlist = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Offset = 0,
) -> NodeHealthPage:
    return q.list_nodes(
        session,
        request.app.state.settings.health,
        verdict=verdict,
        hostlist=nodes,
        limit=limit,
        offset=offset,
    )


@router.get("/health/events", response_model=list[HealthEventPublic])
def health_events(
    session: SessionDep,
    _t: Viewer,
    since: Since = None,
    node: Annotated[str | None, text_query(63)] = None,
    severity: Annotated[
        str | None, Query(max_length=16, pattern=VERDICT_PATTERN, description="warn or fail")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Offset = 0,
) -> list[HealthEventPublic]:
    return q.events(session, since=since, node=node, severity=severity, limit=limit, offset=offset)


@router.get("/nodes/{name}/gpus", response_model=list[GpuHealthPublic])
def node_gpus(name: Name, session: SessionDep, _t: Viewer) -> list[GpuHealthPublic]:
    return q.node_gpus(session, name)


@router.get("/gpus/{uuid}/history", response_model=GpuHistory)
def gpu_history(
    uuid: Annotated[str, Path(max_length=96, pattern=PRINTABLE_PATTERN, description="GPU UUID")],
    session: SessionDep,
    _t: Viewer,
    since: Since = None,
    node: Annotated[str | None, text_query(63, "the node, when several report this UUID")] = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 100,
) -> GpuHistory:
    return q.gpu_history(session, uuid, node=node, limit=limit, since=since)
