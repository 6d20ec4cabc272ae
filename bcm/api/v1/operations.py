"""/api/v1/operations: long jobs, their progress and per-node results."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from bcm.api.deps import SessionDep, Viewer
from bcm.api.params import Offset, RowId
from bcm.models.operation import OperationDetail, OperationPublic
from bcm.services import operations as svc

router = APIRouter(prefix="/operations", tags=["operations"])


@router.get("", response_model=list[OperationPublic])
def list_operations(
    session: SessionDep,
    _t: Viewer,
    kind: str | None = None,
    state: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    offset: Offset = 0,
) -> list[OperationPublic]:
    return [
        OperationPublic.model_validate(o, from_attributes=True)
        for o in svc.query(session, kind=kind, state=state, limit=limit, offset=offset)
    ]


@router.get("/{op_id}", response_model=OperationDetail)
def get_operation(op_id: RowId, session: SessionDep, _t: Viewer) -> OperationDetail:
    return OperationDetail.model_validate(svc.get(session, op_id), from_attributes=True)
