"""Request dependencies: the unit of work (session) and the caller's token."""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable, Iterable
from datetime import timedelta
from typing import Annotated, Any

import anyio
from fastapi import Depends, Request
from fastapi.routing import APIRoute
from sqlalchemy.engine import Engine
from sqlmodel import Session

from bcm.errors import Unauthorized
from bcm.models.auth import ApiToken, Role
from bcm.models.base import utcnow
from bcm.services import auth
from bcm.settings import Settings

LAST_USED_RESOLUTION = timedelta(seconds=60)


def get_engine(request: Request) -> Engine:
    engine: Engine = request.app.state.engine
    return engine


def get_settings_dep(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_session(engine: Annotated[Engine, Depends(get_engine)]) -> AsyncIterator[Session]:
    """The request is the transaction: commit when the handler returns, roll back on any error.

    A plain (``def``) handler commits in its own worker thread as it returns, before its answer is
    serialized (:func:`commit_before_serialization`); what is left here is then nothing to flush. On SQLite the commit runs right here: it is short (WAL), and a hop to a worker thread would keep
    the database's single write turn held while the hop queues behind other requests. Elsewhere it
    runs in a thread of its own, outside the worker-thread limit, so it never waits for a worker that
    waits for a connection.
    """
    session = Session(engine, expire_on_commit=False)
    sqlite = engine.dialect.name == "sqlite"

    async def run(fn: Callable[[], None]) -> None:
        # inline only when nothing is left to flush: a flush could wait for the write turn, and
        # waiting on the event loop would stall the very commits that end other turns
        if sqlite and not (session.new or session.dirty or session.deleted):
            fn()
            return
        with anyio.CancelScope(shield=True):  # a cancelled request still gives its connection back
            await anyio.to_thread.run_sync(fn, limiter=anyio.CapacityLimiter(1))

    try:
        yield session
        await run(session.commit)
    except BaseException:
        await run(session.rollback)
        raise
    finally:
        await run(session.close)


SessionDep = Annotated[Session, Depends(get_session, scope="function")]


_COMMITTING: set[Callable[..., Any]] = set()  # handlers already wrapped


def _committing(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(endpoint)  # FastAPI reads the handler's own signature through the wrapper
    def commit_on_return(*args: Any, **values: Any) -> Any:
        result = endpoint(*args, **values)
        for value in values.values():
            if isinstance(value, Session) and value.in_transaction():
                value.commit()
        return result

    _COMMITTING.add(commit_on_return)
    return commit_on_return


def commit_before_serialization(routes: Iterable[Any]) -> None:
    """Every plain (``def``) handler that takes a session commits it in its own thread as it returns.

    FastAPI ends a dependency only after the answer is serialized, and for a ``def`` handler that
    serialization waits for another worker thread: a handler that wrote would keep SQLite's write turn
    (``bcm.db``) across that wait, while the threads it waits for wait for the turn (#27). Committing
    first gives the turn back before the answer is built, in the thread that took it. Call it once every
    router is included and before the first request (included routers build their handlers on first use).
    """
    for route in routes:
        included = getattr(route, "original_router", None)  # an included router: its own routes
        if included is not None:
            commit_before_serialization(included.routes)
            continue
        if not isinstance(route, APIRoute):
            continue
        endpoint = route.endpoint
        plain = inspect.unwrap(endpoint)
        if endpoint in _COMMITTING or inspect.iscoroutinefunction(plain):
            continue
        if inspect.isgeneratorfunction(plain) or inspect.isasyncgenfunction(plain):
            continue
        wrapped = _committing(endpoint)
        route.endpoint = wrapped
        if route.dependant.call is endpoint:  # a route of the app itself: its handler is built already
            route.dependant.call = wrapped


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def verified_token(request: Request, session: Session) -> ApiToken:
    """The caller's live token; failures are logged (never the token) and braked per client address.

    The token is verified first: a valid one passes even from an address braked for failing too often
    (the brake slows guessing; it must not lock the rightful holder out of a shared address).
    """
    presented = bearer(request)
    try:
        return auth.verify(session, presented)
    except Unauthorized as exc:
        if not presented:  # a missing token is a client not set up yet, not a guess
            raise
        client = request.client.host if request.client else "unknown"
        raise request.app.state.auth_failures.refusal(client, request.url.path, exc.message, exc) from None


def current_token(request: Request, session: SessionDep) -> ApiToken:
    token = verified_token(request, session)
    now = utcnow()
    # at most one write a minute per token: a read request should not have to write
    if token.last_used_at is None or now - token.last_used_at > LAST_USED_RESOLUTION:
        token.last_used_at = now
        session.add(token)
    request.state.actor = f"{token.role}:{token.name}"
    # give the connection back now: the handler may await for long (verbs, SSH) without one, and a
    # handler that needs the database takes one again for its own (short) transaction
    session.commit()
    return token


def require(role: Role) -> Callable[..., ApiToken]:
    """A dependency that lets through tokens of ``role`` or higher (node tokens only to node routes)."""

    def _check(token: Annotated[ApiToken, Depends(current_token)]) -> ApiToken:
        auth.require_role(token, role)
        return token

    return _check


Caller = Annotated[ApiToken, Depends(require(Role.USER))]  # any person; tenancy routes check scope themselves
Viewer = Annotated[ApiToken, Depends(require(Role.VIEWER))]
Operator = Annotated[ApiToken, Depends(require(Role.OPERATOR))]
Admin = Annotated[ApiToken, Depends(require(Role.ADMIN))]
NodeToken = Annotated[ApiToken, Depends(require(Role.NODE))]


def actor(token: ApiToken) -> str:
    return f"{token.role}:{token.name}"
