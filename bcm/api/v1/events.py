"""/api/v1/events: the audit log."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from bcm.api.deps import SessionDep, Viewer
from bcm.api.params import Offset, Since, text_query
from bcm.models.event import EventPublic
from bcm.services import events as svc

router = APIRouter(prefix="/events", tags=["events"])


@router.get("", response_model=list[EventPublic])
def list_events(
    session: SessionDep,
    _t: Viewer,
    since: Since = None,
    action: Annotated[str | None, text_query(64)] = None,
    target: Annotated[str | None, text_query(4096)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Offset = 0,
) -> list[EventPublic]:
    rows = svc.query(session, since=since, action=action, target=target, limit=limit, offset=offset)
    return [EventPublic.model_validate(e, from_attributes=True) for e in rows]
