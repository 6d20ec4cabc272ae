"""POST /boot/v1/agent/report: the node-facing endpoint where agents deliver GPU health reports.

Only a node's own agent token is accepted; the node is known from the token, never from the body
(a report naming another host is refused with 403). The body is capped at ``MAX_REPORT_BYTES``
before it is parsed (413 beyond it); a malformed report is a 422; either way nothing is stored.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, status
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask

from bcm.api.deps import bearer
from bcm.domain.health_report import MAX_REPORT_BYTES
from bcm.errors import PayloadTooLarge, Unauthorized
from bcm.models.health import ReportAccepted

router = APIRouter(prefix="/boot/v1/agent", tags=["boot"])
REPORT_PATH = "/boot/v1/agent/report"  # capped here, parsed by pydantic: exempt from BodyLimits


async def capped_body(request: Request) -> bytes:
    """The request body, refused (413) as soon as it passes MAX_REPORT_BYTES."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_REPORT_BYTES:
        raise PayloadTooLarge(f"report of {declared} bytes exceeds the limit of {MAX_REPORT_BYTES}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_REPORT_BYTES:
            raise PayloadTooLarge(f"report exceeds the limit of {MAX_REPORT_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


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
    body = await capped_body(request)
    failures = request.app.state.auth_failures
    client = request.client.host if request.client else "unknown"
    failures.check(client)
    try:  # parsed and validated by the writer, after the token check (bcm.workers.ingest)
        result = await request.app.state.ingest.submit(token, body)
    except Unauthorized as exc:
        failures.failed(client, request.url.path, exc.message)
        raise
    background = None
    if result.action is not None:
        # runs after the response; the decision was committed with the report
        from bcm.workers.health import apply_pending

        state = request.app.state
        background = BackgroundTask(apply_pending, state.engine, state.settings, [result.node_id])
    accepted = {"node": result.node, "verdict": result.verdict, "report_verdict": result.report_verdict,
                "action": result.action}  # fmt: skip
    return JSONResponse(accepted, status_code=status.HTTP_202_ACCEPTED, background=background)
