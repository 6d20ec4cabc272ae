"""The web dashboard at ``/ui/``: server-rendered pages (Jinja2, autoescaped), a few lines of JavaScript,
inline SVG charts; every asset served by bcm itself (air-gapped head nodes).

    session.py   sign-in cookie (HMAC-signed token id + expiry, no secret in it) and CSRF tokens
    web.py       the template environment, security headers (CSP), HTML errors, the session dependency
    queries.py   the Nodes table and Overview counts (what the services do not already answer)
    charts.py    pure SVG line/bar charts from a GPU's history
    routes.py    the pages; actions.py the forms that change things (role-checked, CSRF-checked)
    live.py      an operation's log as server-sent events
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

STATIC_DIR = Path(__file__).resolve().parent / "static"


class _StaticHeaders:
    """The static files with the dashboard's security headers and a short cache lifetime."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        from bcm.ui.web import SECURITY_HEADERS

        async def with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
                headers.append((b"cache-control", b"max-age=3600"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


def install(app: Any) -> None:
    """Serve the dashboard at /ui/ (pages, actions, the live log, static files)."""
    from starlette.staticfiles import StaticFiles

    from bcm.ui import actions, live, routes

    app.include_router(actions.router)
    app.include_router(live.router)
    app.include_router(routes.router)
    app.mount("/ui/static", _StaticHeaders(StaticFiles(directory=STATIC_DIR)), name="ui-static")
