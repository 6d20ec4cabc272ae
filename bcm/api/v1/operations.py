"""/api/v1/operations: long jobs, their progress and per-node results."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import APIRouter, Path, Query, Request
from sqlmodel import Session

from bcm.api.deps import Operator, SessionDep, Viewer, actor
from bcm.api.params import Offset, RowId, text_query
from bcm.models.operation import OperationDetail, OperationPublic
from bcm.services import operations as svc

router = APIRouter(prefix="/operations", tags=["operations"])


@router.get("", response_model=list[OperationPublic])
def list_operations(
    session: SessionDep,
    _t: Viewer,
    kind: Annotated[str | None, text_query(32)] = None,
    state: Annotated[str | None, text_query(16)] = None,
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


@router.post("/{op_id}/cancel", response_model=OperationDetail)
async def cancel_operation(
    op_id: Annotated[int, Path(ge=1, le=2_147_483_647)], request: Request, token: Operator
) -> OperationDetail:
    """Stop an operation: it ends ``cancelled``, per-node results kept, its node locks released."""
    await request.app.state.runner.cancel(op_id, actor(token))
    engine = request.app.state.engine

    def read() -> OperationDetail:
        with Session(engine) as s:
            return OperationDetail.model_validate(svc.get(s, op_id), from_attributes=True)

    return await anyio.to_thread.run_sync(read)
