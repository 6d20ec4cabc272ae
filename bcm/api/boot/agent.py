"""POST /boot/v1/agent/report: the node-facing endpoint where agents deliver GPU health reports.

Only a node's own agent token is accepted; the node is known from the token, never from the body
(a report naming another host is refused with 403). The body is capped at ``MAX_REPORT_BYTES``
before it is parsed (413 beyond it) and must arrive within ``http.body_timeout_s`` (408); a body that is
not UTF-8 without a byte-order mark is a 400, a NUL character in it or a malformed report a 422 (after
the token is checked); either way nothing is stored.
"""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Depends, Request, status
from fastapi.responses import JSONResponse, Response
from sqlmodel import Field, SQLModel
from starlette.background import BackgroundTask

from bcm.api.deps import bearer
from bcm.api.limits import RequestTimeout, json_text, nul_refusal
from bcm.db import session_scope
from bcm.domain.health_report import MAX_REPORT_BYTES
from bcm.errors import BcmError, Forbidden, PayloadTooLarge, Unauthorized
from bcm.models.base import utcnow
from bcm.models.health import ReportAccepted

router = APIRouter(prefix="/boot/v1/agent", tags=["boot"])
REPORT_PATH = "/boot/v1/agent/report"  # capped here, parsed by pydantic: exempt from BodyLimits
MAX_FACTS_CHARS = 2_000_000  # the fact script's output (the body is bounded by BodyLimits before this)


class FactsPush(SQLModel):
    """What ``bcm-agent`` sends at start on a node bcm booted: the fact script's output, run locally."""

    output: str = Field(max_length=MAX_FACTS_CHARS)


async def capped_body(request: Request, timeout_s: float | None = None) -> bytes:
    """The request body, refused (413) as soon as it passes MAX_REPORT_BYTES, or (408) when it has not
    all arrived within ``timeout_s`` (default ``http.body_timeout_s``)."""
    if timeout_s is None:
        timeout_s = request.app.state.settings.http.body_timeout_s
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_REPORT_BYTES:
        raise PayloadTooLarge(f"report of {declared} bytes exceeds the limit of {MAX_REPORT_BYTES}")
    chunks, size = [], 0
    with anyio.move_on_after(timeout_s) as timer:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_REPORT_BYTES:
                raise PayloadTooLarge(f"report exceeds the limit of {MAX_REPORT_BYTES} bytes")
            chunks.append(chunk)
    if timer.cancelled_caught:
        raise RequestTimeout(f"body: not received within {timeout_s:g} s", field="body")
    return b"".join(chunks)


def body_problem(body: bytes) -> BcmError | None:
    """What the report's bytes break before any parser sees them: not UTF-8 without a BOM (400), a NUL
    character in a string (422 naming the field; PostgreSQL stores none)."""
    try:
        json_text(body)
    except BcmError as exc:
        return exc
    return nul_refusal(body)


MISSING_BEARER = "no token: send `Authorization: Bearer <node token>`"


def bearer_present(request: Request) -> None:
    """A request without a token is a 401 before its body is read (a wrong one is found in ``work``)."""
    if bearer(request) is None:
        raise Unauthorized(MISSING_BEARER)


@router.post(
    "/report",
    response_model=ReportAccepted,
    status_code=status.HTTP_202_ACCEPTED,
)
async def report(request: Request) -> Response:
    """Store a node's health report (its own node only) and judge it.

    The report is parsed, validated and written with the others that arrive meanwhile
    (:class:`bcm.workers.ingest.IngestQueue`: one transaction checks every token and stores every report
    of a batch, in a writer thread or process); the answer comes once this report is committed. A wrong token is a 401 even when the
    report is malformed too; no token at all is a 401 before the body is read.

    The busiest route (every node, every interval) takes only the request and answers a ready
    ``Response``: no dependencies to solve and no response model pass (about a third of its cost).
    """
    token = bearer(request)
    if token is None:
        raise Unauthorized(MISSING_BEARER)  # before the body is read
    state = request.app.state
    body = await capped_body(request, state.settings.http.body_timeout_s)
    try:  # parsed and validated by the writer, after the token check (bcm.workers.ingest)
        result = await state.ingest.submit(token, body_problem(body) or body)
    except Unauthorized as exc:
        # verified first: a valid token passes even from an address braked for others' guesses
        client = request.client.host if request.client else "unknown"
        raise state.auth_failures.refusal(client, request.url.path, exc.message, exc) from None
    background = None
    if result.action is not None:
        # runs after the response; the decision was committed with the report
        from bcm.workers.health import apply_pending

        background = BackgroundTask(apply_pending, state.engine, state.settings, [result.node_id])
    accepted = {
        "node": result.node,
        "verdict": result.verdict,
        "report_verdict": result.report_verdict,
        "action": result.action,
    }
    return JSONResponse(accepted, status_code=status.HTTP_202_ACCEPTED, background=background)


@router.post("/facts", dependencies=[Depends(bearer_present)])
async def facts(body: FactsPush, request: Request) -> dict[str, object]:
    """A node's agent sends its hardware facts (its own node only: the node comes from the token); stored as
    an SSH inventory's are. A wrong token counts toward the auth brake like a report's."""
    from datetime import timedelta

    from bcm.services import auth
    from bcm.services import inventory as inventory_svc

    token = bearer(request)
    if token is None:
        raise Unauthorized(MISSING_BEARER)
    state = request.app.state

    def work() -> dict[str, object]:
        with session_scope(state.engine) as session:
            row = auth.node_tokens(session, [token], utcnow() - timedelta(minutes=1))[token]
            if isinstance(row, BcmError):
                raise row
            return inventory_svc.store_agent_facts(session, row.node_id or 0, body.output)

    try:
        return await anyio.to_thread.run_sync(work)
    except (Unauthorized, Forbidden) as exc:
        client = request.client.host if request.client else "unknown"
        raise state.auth_failures.refusal(client, request.url.path, exc.message, exc) from None
