"""Request dependencies: the unit of work (session) and the caller's token."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.engine import Engine
from sqlmodel import Session

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


def get_session(engine: Annotated[Engine, Depends(get_engine)]) -> Iterator[Session]:
    """The request is the transaction: commit when the handler returns, roll back on any error."""
    with Session(engine, expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


SessionDep = Annotated[Session, Depends(get_session, scope="function")]
SettingsDep = Annotated[Settings, Depends(get_settings_dep)]


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def current_token(request: Request, session: SessionDep) -> ApiToken:
    token = auth.verify(session, bearer(request))
    now = utcnow()
    # at most one write a minute per token: a read request should not have to write
    if token.last_used_at is None or now - token.last_used_at > LAST_USED_RESOLUTION:
        token.last_used_at = now
        session.add(token)
    request.state.actor = f"{token.role}:{token.name}"
    return token


def require(role: Role) -> Callable[..., ApiToken]:
    """A dependency that lets through tokens of ``role`` or higher (node tokens only to node routes)."""

    def _check(token: Annotated[ApiToken, Depends(current_token)]) -> ApiToken:
        auth.require_role(token, role)
        return token

    return _check


Viewer = Annotated[ApiToken, Depends(require(Role.VIEWER))]
Operator = Annotated[ApiToken, Depends(require(Role.OPERATOR))]
Admin = Annotated[ApiToken, Depends(require(Role.ADMIN))]
NodeToken = Annotated[ApiToken, Depends(require(Role.NODE))]


def actor(token: ApiToken) -> str:
    return f"{token.role}:{token.name}"
