"""What every dashboard page shares: templates (autoescaped), security headers, the signed-in user, and
errors answered as pages (a refused or bad request is a 4xx page with the reason, never a 500)."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from typing import Annotated, Any
from urllib.parse import quote

import jinja2
from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.routing import APIRoute

from bcm.api.deps import SessionDep
from bcm.errors import BcmError
from bcm.models.auth import ApiToken, Role
from bcm.services import render as template_files
from bcm.ui import session as sessions

log = logging.getLogger("bcm.ui")

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
}
PAGE_HEADERS = {**SECURITY_HEADERS, "Cache-Control": "no-store"}


class SignInNeeded(Exception):
    """No valid session: the page answers with a redirect to the sign-in form."""


@dataclass(frozen=True)
class UiUser:
    token: ApiToken
    ref: sessions.SessionRef
    csrf: str

    @property
    def role(self) -> Role:
        return Role(self.token.role)

    @property
    def can_act(self) -> bool:
        return self.role.rank >= Role.OPERATOR.rank

    @property
    def actor(self) -> str:
        return f"{self.token.role}:{self.token.name}"


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(d) for d in template_files.template_dirs()]),
        undefined=jinja2.StrictUndefined,
        autoescape=True,  # every value from a node, an agent or a discovery is text, never markup
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["when"] = _when
    env.filters["mib"] = lambda v: "–" if v is None else f"{v / 1024:.0f} GiB"
    env.filters["bytes"] = _bytes
    return env


def _when(value: datetime | None) -> str:
    if value is None:
        return "–"
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _bytes(value: int | None) -> str:
    if value is None:
        return "–"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(value)


def render(
    request: Request, name: str, context: dict[str, Any], status_code: int = 200, *, etag: bool = False
) -> Response:
    """A page; with ``etag``, a 304 when the client's copy is the same (the live tables poll this way)."""
    me: UiUser | None = getattr(request.state, "ui_user", None)
    html = environment().get_template(name).render(me=me, path=request.url.path, **context)
    headers = dict(PAGE_HEADERS)
    if etag:
        tag = '"' + hashlib.sha256(html.encode()).hexdigest()[:32] + '"'
        headers["ETag"] = tag
        if request.headers.get("if-none-match") == tag:
            return Response(status_code=304, headers=headers)
    return HTMLResponse(html, status_code=status_code, headers=headers)


def error_page(request: Request, status_code: int, message: str) -> Response:
    return render(request, "ui/error.html", {"status": status_code, "message": message}, status_code)


def redirect(url: str) -> RedirectResponse:
    return RedirectResponse(url, status_code=303, headers=PAGE_HEADERS)


def _validation_message(exc: RequestValidationError) -> str:
    first = (exc.errors() or [{}])[0]
    field = ".".join(str(p) for p in first.get("loc", ()) if p not in ("query", "path", "body")) or "request"
    return f"{field}: {str(first.get('msg', 'invalid')).removeprefix('Value error, ')}"


class UiRoute(APIRoute):
    """Routes of the dashboard: no session → the sign-in page; errors → an HTML page with the reason."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def run(request: Request) -> Response:
            started = time.perf_counter()
            response = await answer(request)
            # the page's own time on the server (bench/ui.py reads it; browsers show it in their tools)
            response.headers["Server-Timing"] = f"app;dur={(time.perf_counter() - started) * 1000:.1f}"
            return response

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except SignInNeeded:
                target = request.url.path if request.method == "GET" else "/ui/"
                return redirect("/ui/signin?next=" + quote(target, safe="/"))
            except RequestValidationError as exc:
                return error_page(request, 400, _validation_message(exc))
            except BcmError as exc:
                response = error_page(request, exc.status_code, exc.message)
                response.headers.update(exc.headers())
                return response

        return run


def current_user(request: Request, session: SessionDep) -> UiUser:
    """The signed-in person (viewer or higher); SignInNeeded otherwise."""
    state_dir = request.app.state.settings.state_dir
    ref = sessions.read(state_dir, request.cookies.get(sessions.COOKIE))
    if ref is None:
        raise SignInNeeded
    token = session.get(ApiToken, ref.token_id)
    if token is None or token.revoked_at is not None or Role(token.role).rank < Role.VIEWER.rank:
        raise SignInNeeded  # gone, revoked, or a node's or a tenancy user's token: never a dashboard session
    user = UiUser(token, ref, sessions.csrf_token(state_dir, ref.nonce))
    request.state.ui_user = user
    return user


Me = Annotated[UiUser, Depends(current_user)]


def check_csrf(request: Request, me: UiUser, form: dict[str, str]) -> None:
    from bcm.errors import Forbidden

    if not sessions.csrf_ok(request.app.state.settings.state_dir, me.ref.nonce, form.get("csrf")):
        raise Forbidden("this form is out of date or was not sent from the dashboard (CSRF); reload the page")


def require_operator(me: UiUser) -> None:
    from bcm.services import auth

    auth.require_role(me.token, Role.OPERATOR)


async def read_form(request: Request) -> dict[str, str]:
    """A urlencoded form, the last value of each field (``nodes`` checkboxes are joined with commas)."""
    from urllib.parse import parse_qsl

    from bcm.errors import BadRequest

    body = await request.body()
    try:
        pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, max_num_fields=25_000)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"form: {exc}") from None
    form: dict[str, str] = {}
    selected: list[str] = []
    for k, v in pairs:
        if k == "node":
            selected.append(v)
        else:
            form[k] = v
    if selected:
        form["selected"] = ",".join(selected)
    return form
