"""The FastAPI application: routers, error translation, start-up work."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from bcm import __version__, db_errors
from bcm.api import metrics, responses
from bcm.api.boot import agent as boot_agent
from bcm.api.deps import Viewer, commit_before_serialization
from bcm.api.limits import AuthFailures, BodyLimits
from bcm.api.readiness import Readiness
from bcm.api.responses import ERRORS
from bcm.api.v1 import agents, categories, events, health, nodes, operations, ssh, tenancy, tokens, wlm
from bcm.errors import BcmError, Unavailable
from bcm.settings import Settings
from bcm.workers.supervise import stop_all

log = logging.getLogger("bcm.api")


def _field_of(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or "body"


async def _bcm_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, BcmError)
    return JSONResponse(status_code=exc.status_code, content=exc.to_dict(), headers=exc.headers())


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    details = []
    for err in exc.errors():
        field = "body" if err.get("type") == "json_invalid" else _field_of(err.get("loc", ()))
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        details.append({"field": field, "message": msg})
    first = details[0] if details else {"field": "body", "message": "invalid request"}
    message = (
        first["message"]
        if first["message"].startswith(first["field"] + ":")
        else (f"{first['field']}: {first['message']}")
    )
    return JSONResponse(
        status_code=422,
        content={"error": "InvalidInput", "message": message, "field": first["field"], "details": details},
    )


async def _database_error(_request: Request, exc: Exception) -> JSONResponse:
    """Every database failure (and a full disk) answered in one place: 503 + Retry-After, 409, 507."""
    err = db_errors.translate(exc) or BcmError("internal error")
    # never the exception text: it carries the statement's parameters (tokens, passwords)
    cause = type(getattr(exc, "orig", None) or exc).__name__
    if err.status_code == 500:
        statement = str(getattr(exc, "statement", ""))[:200]
        log.error("unexpected database error %s (%s): %s", type(exc).__name__, cause, statement)
    else:
        log.info("database error %s (%s) answered %s", type(exc).__name__, cause, err.status_code)
    headers = {"Retry-After": str(err.retry_after)} if isinstance(err, Unavailable) else None
    return JSONResponse(status_code=err.status_code, content=err.to_dict(), headers=headers)


def create_app(settings: Settings, engine: Engine) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from bcm.workers.health import HealthWorker
        from bcm.workers.ingest import IngestQueue
        from bcm.workers.runner import Runner

        app.state.readiness = Readiness(engine, settings.db)
        app.state.runner = Runner(engine, settings)
        await app.state.runner.start()
        app.state.health = HealthWorker(engine, settings)
        app.state.ingest = IngestQueue(engine, settings)
        from bcm.workers import provision

        await anyio.to_thread.run_sync(provision.load_config, engine, settings)
        app.state.dhcp = None
        app.state.provisioner = provision.Provisioner(engine, settings, app.state.runner, None)
        app.state.runner.provisioner = app.state.provisioner
        from bcm.workers.deltas import Deltas
        from bcm.workers.leader import Leadership

        app.state.deltas = Deltas()  # auto installs' image deltas, off the request pool (#30)
        # the leader runs dnsmasq, the provisioning queue, health drains, WLM sync, the power poll and
        # pruning (a lone server leads from its first request on); every server the API, boot files, ingest
        app.state.ha = Leadership(app)
        await app.state.ha.start()
        try:
            yield
        finally:
            # every step runs, each bounded, whatever the one before raised (#27)
            await stop_all(
                [
                    (
                        "leader work",
                        app.state.ha.stop,
                    ),  # dnsmasq, provisioning, health, WLM sync, polls; the lease
                    ("health ingest", app.state.ingest.stop),  # taken reports are written, new ones get a 503
                    ("provisioner", app.state.provisioner.stop),
                    ("image deltas", app.state.deltas.stop),
                    ("operations", app.state.runner.shutdown),
                    ("readiness probe", app.state.readiness.close),
                ]
            )

    app = FastAPI(
        title="bcm",
        version=__version__,
        lifespan=lifespan,
        description="Head-node server for bare-metal GPU clusters",
        openapi_url=None,  # served below, behind a viewer token like the API it describes
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.auth_failures = AuthFailures(settings.http.auth_failures_per_minute)
    app.add_middleware(
        BodyLimits,
        max_body_bytes=settings.http.max_body_bytes,
        max_json_depth=settings.http.max_json_depth,
        self_limited=frozenset({boot_agent.REPORT_PATH}),
        body_timeout_s=settings.http.body_timeout_s,
    )
    app.add_exception_handler(BcmError, _bcm_error)
    responses.install(app)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(SQLAlchemyError, _database_error)
    app.add_exception_handler(OSError, _database_error)  # ENOSPC: 507; anything else a JSON 500

    @app.get("/healthz", tags=["meta"])
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers (on the event loop: no worker thread, no database, no lock)."""
        return {"status": "ok", "version": __version__}

    @app.get("/readyz", tags=["meta"])
    async def readyz(request: Request) -> JSONResponse:
        """Readiness: the database answers; 503 with Retry-After while it does not (a probe of its own,
        never a request worker thread or the write turn: :class:`bcm.api.readiness.Readiness`)."""
        readiness: Readiness | None = getattr(request.app.state, "readiness", None)
        if readiness is None:  # before the lifespan started (a bare TestClient)
            readiness = request.app.state.readiness = Readiness(engine, settings.db)
        ready_err = await readiness.check()
        if ready_err is not None:
            headers = {"Retry-After": str(ready_err.retry_after)}
            return JSONResponse(status_code=503, content=ready_err.to_dict(), headers=headers)
        return JSONResponse({"status": "ready", "version": __version__})

    @app.get("/openapi.json", include_in_schema=False)
    def openapi(_token: Viewer) -> JSONResponse:
        """The API's OpenAPI document (viewer token)."""
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    def docs(_token: Viewer) -> HTMLResponse:
        """Swagger UI for the OpenAPI document (viewer token)."""
        return get_swagger_ui_html(openapi_url="/openapi.json", title="bcm API")

    from bcm.api.v1 import power

    # first: the busiest route (every node, every interval); routes are matched in order
    app.include_router(boot_agent.router, responses=ERRORS)  # POST /boot/v1/agent/report (node tokens only)
    app.include_router(
        power.router, prefix="/api/v1", responses=ERRORS
    )  # before nodes: /nodes/actions/power-* is its own
    from bcm.api.boot import images as boot_images
    from bcm.api.v1 import discovered, images, pxe

    for module in (
        nodes,
        categories,
        operations,
        events,
        tokens,
        ssh,
        health,
        agents,
        wlm,
        images,
        discovered,
        pxe,
    ):
        app.include_router(module.router, prefix="/api/v1", responses=ERRORS)
    from bcm.api.v1 import ha

    app.include_router(ha.router, prefix="/api/v1", responses=ERRORS)
    app.include_router(ha.probe)  # GET /leaderz (no token): keepalived's check
    app.include_router(tokens.users, prefix="/api/v1", responses=ERRORS)
    for tenancy_router in (tenancy.departments, tenancy.projects, tenancy.router):
        app.include_router(tenancy_router, prefix="/api/v1", responses=ERRORS)
    app.include_router(metrics.router, responses=ERRORS)  # GET /metrics (viewer+)
    app.include_router(boot_images.router, responses=ERRORS)  # GET /boot/v1/images/… (no token, no secrets)
    from bcm.api.boot import pxe as boot_pxe

    app.include_router(boot_pxe.router, responses=ERRORS)  # iPXE scripts, discovery, overlay, callback
    from bcm import ui

    ui.install(app)  # the dashboard at /ui/ (session cookie, not a token; its own security headers)
    commit_before_serialization(app.routes)  # last: every route is in place
    return app
