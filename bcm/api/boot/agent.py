"""POST /boot/v1/agent/report: the node-facing endpoint where agents deliver GPU health reports.

Only a node's own agent token is accepted; the node is known from the token, never from the body
(a report naming another host is refused with 403). The body is capped at ``MAX_REPORT_BYTES``
before it is parsed; an oversize or malformed report is a 422 and nothing is stored.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

import anyio
from fastapi import APIRouter, BackgroundTasks, Depends, Request, status
from pydantic import ValidationError
from sqlmodel import Session

from bcm.api.deps import bearer, verified_token
from bcm.db import session_scope
from bcm.domain.health_report import MAX_REPORT_BYTES, HealthReport
from bcm.errors import Forbidden, InvalidInput, Unauthorized
from bcm.models.auth import ApiToken, Role
from bcm.models.base import utcnow
from bcm.models.health import ReportAccepted
from bcm.services import health as svc

router = APIRouter(prefix="/boot/v1/agent", tags=["boot"])
# Writing last_used_at on every report would double the writes of the busiest endpoint.
TOKEN_TOUCH_EVERY = timedelta(minutes=5)


def node_only_token(request: Request, session: Session) -> ApiToken:
    """The caller's token, which must be a node's agent token (admin and user tokens are refused)."""
    token = verified_token(request, session)
    if token.role != Role.NODE.value or token.node_id is None:
        raise Forbidden("this endpoint takes a node's agent token (issue one with `bcm node token NODE`)")
    now = utcnow()
    if token.last_used_at is None or now - token.last_used_at > TOKEN_TOUCH_EVERY:
        token.last_used_at = now
        session.add(token)
    return token



async def capped_body(request: Request) -> bytes:
    """The request body, refused (422) as soon as it passes MAX_REPORT_BYTES."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_REPORT_BYTES:
        raise InvalidInput(
            f"report of {declared} bytes exceeds the limit of {MAX_REPORT_BYTES}", field="body"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_REPORT_BYTES:
            raise InvalidInput(f"report exceeds the limit of {MAX_REPORT_BYTES} bytes", field="body")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_report(body: bytes) -> HealthReport:
    try:
        return HealthReport.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid report"}
        field = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise InvalidInput(f"{field}: {first.get('msg', 'invalid')}", field=field) from None


def bearer_present(request: Request) -> None:
    """A request without a token is a 401 before its body is read (a wrong one is found in ``work``)."""
    if bearer(request) is None:
        raise Unauthorized("no token: send `Authorization: Bearer <node token>`")


@router.post(
    "/report",
    response_model=ReportAccepted,
    status_code=status.HTTP_202_ACCEPTED,
    dependencies=[Depends(bearer_present)],
)
async def report(
    body: Annotated[bytes, Depends(capped_body)],
    request: Request,
    background: BackgroundTasks,
) -> ReportAccepted:
    """Store a node's health report (its own node only) and judge it.

    The token check, parsing, ingest and commit run in one worker thread with one session (one
    connection, one transaction): on SQLite the write turn taken by the first insert is given back by the
    commit in that same thread, never held while the request waits for another thread (with every worker
    waiting for the turn, that wait never ended).
    """
    engine, settings = request.app.state.engine, request.app.state.settings

    def work() -> svc.IngestResult:
        with session_scope(engine) as session:
            token = node_only_token(request, session)
            assert token.node_id is not None
            parsed = parse_report(body)
            return svc.ingest(session, token.node_id, parsed, settings.health)

    result = await anyio.to_thread.run_sync(work)
    if result.action is not None:
        # runs after the response; the decision was committed above
        from bcm.workers.health import apply_pending

        background.add_task(apply_pending, engine, settings, [result.node_id])
    return ReportAccepted(
        node=result.node, verdict=result.verdict, report_verdict=result.report_verdict, action=result.action
    )
