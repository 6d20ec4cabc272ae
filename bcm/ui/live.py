"""An operation's log as server-sent events: what was added since the client's last event, every half
second, until the operation ends (then an ``end`` event) or the stream's time is up (the browser's
EventSource reconnects and resumes from ``Last-Event-ID``). No database connection is held between polls."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import Response, StreamingResponse
from sqlmodel import Session

from bcm.services import operations as op_svc
from bcm.ui.web import SECURITY_HEADERS, Me, UiRoute

router = APIRouter(prefix="/ui", route_class=UiRoute, include_in_schema=False)
POLL_S = 0.5
STREAM_S = 300.0  # one response at most this long; the browser reconnects with Last-Event-ID
CHUNK_CHARS = 64_000
KEEPALIVE_S = 15.0


def _read(engine: Any, op_id: int) -> tuple[str, dict[str, Any]]:
    with Session(engine) as s:
        op = op_svc.get(s, op_id)
        status = {
            "state": op.state,
            "done": op.progress_done,
            "total": op.progress_total,
            "finished": op_svc.is_finished(op),
            "error": op.error,
        }
        return op.log, status


def _event(offset: int, data: dict[str, Any], kind: str | None = None) -> str:
    head = f"event: {kind}\n" if kind else ""
    return f"{head}id: {offset}\ndata: {json.dumps(data)}\n\n"


@router.get("/operations/{op_id}/log")
async def operation_log(
    request: Request,
    op_id: Annotated[int, Path(ge=1, le=2_147_483_647)],
    me: Me,
    start_at: Annotated[int, Query(alias="from", ge=0, le=2_147_483_647)] = 0,
) -> Response:
    engine = request.app.state.engine
    await anyio.to_thread.run_sync(_read, engine, op_id)  # 404 now, not inside the stream
    last = request.headers.get("last-event-id", "")
    start = int(last) if last.isdigit() and len(last) < 12 else start_at

    async def stream() -> AsyncIterator[str]:
        offset, deadline = start, time.monotonic() + STREAM_S
        sent: dict[str, Any] | None = None
        quiet_since = time.monotonic()
        yield "retry: 2000\n\n"
        while True:  # bounded: the operation's end, the stream's deadline, or the client leaving
            log, status = await anyio.to_thread.run_sync(_read, engine, op_id)
            if offset > len(log):  # the log was trimmed at its start: send what is kept
                offset = max(0, len(log) - CHUNK_CHARS)
            while offset < len(log):
                piece = log[offset : offset + CHUNK_CHARS]
                offset += len(piece)
                sent, quiet_since = status, time.monotonic()
                yield _event(offset, {"log": piece, **status})
            if status["finished"]:
                yield _event(offset, status, "end")
                return
            if status != sent:  # progress without a log line
                sent, quiet_since = status, time.monotonic()
                yield _event(offset, {"log": "", **status})
            elif time.monotonic() - quiet_since > KEEPALIVE_S:  # a comment keeps proxies from closing it
                quiet_since = time.monotonic()
                yield ": still running\n\n"
            if time.monotonic() > deadline or await request.is_disconnected():
                return
            await asyncio.sleep(POLL_S)

    headers = {**SECURITY_HEADERS, "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)
