"""What the API documents beside each route's success: the error body and every 4xx/5xx bcm answers,
and a ``405`` whose ``Allow`` header names every method of the path (not just one route's)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match


class ErrorBody(BaseModel):
    """Every error bcm answers: the error's kind, one readable line, and the field at fault if any."""

    error: str
    message: str
    field: str | None = None
    details: list[dict[str, Any]] | None = None


_MEANINGS = {
    400: "the body is not something bcm will parse (JSON nested too deep)",
    401: "no token, or an unknown or revoked one",
    403: "the token's role may not do this",
    404: "a named object does not exist",
    409: "the request clashes with stored state (duplicate, illegal transition, lock held)",
    413: "the body exceeds the configured limit",
    422: "a field is malformed or out of range; `field` names it",
    429: "too many failed authentications from this address; see Retry-After",
    503: "the database is unavailable or busy; see Retry-After",
    507: "the database's disk is full; reads are still served",
}
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": meaning} for code, meaning in _MEANINGS.items()
}


async def method_not_allowed(request: Request, exc: Exception) -> JSONResponse:
    """404/405 and other routing errors as JSON; a 405 lists every method the path takes."""
    assert isinstance(exc, StarletteHTTPException)
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        methods: set[str] = set()
        for route in request.app.router.routes:
            match, _ = route.matches({**request.scope, "method": "GET"})
            if match != Match.NONE:
                methods |= set(getattr(route, "methods", None) or ())
        # HEAD is implied by GET and not documented apart from it
        headers["Allow"] = ", ".join(sorted(methods - {"HEAD"}))
    body = {
        "error": "MethodNotAllowed" if exc.status_code == 405 else "HTTPError",
        "message": str(exc.detail),
    }
    return JSONResponse(status_code=exc.status_code, content=body, headers=headers)


def install(app: FastAPI) -> None:
    app.add_exception_handler(StarletteHTTPException, method_not_allowed)
