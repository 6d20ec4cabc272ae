"""/api/v1/tokens: API tokens (admin only). A token's secret is shown once, at creation."""

from __future__ import annotations

from fastapi import APIRouter, status

from bcm.api.deps import Admin, SessionDep, actor
from bcm.api.params import Name, RowId
from bcm.errors import InvalidInput
from bcm.models.auth import Role, TokenCreate, TokenCreated, TokenPublic, UserCreate, UserPublic
from bcm.services import auth as svc
from bcm.services import events

router = APIRouter(prefix="/tokens", tags=["tokens"])


@router.get("", response_model=list[TokenPublic])
def list_tokens(session: SessionDep, _t: Admin, include_revoked: bool = False) -> list[TokenPublic]:
    return [svc.token_public(session, t) for t in svc.list_tokens(session, include_revoked)]


@router.post("", response_model=TokenCreated, status_code=status.HTTP_201_CREATED)
def create_token(spec: TokenCreate, session: SessionDep, token: Admin) -> TokenCreated:
    if spec.role is Role.NODE:
        raise InvalidInput("role: node tokens are issued per node (bcm node token NODE)", field="role")
    row, secret = svc.issue(session, spec.name, spec.role, user=spec.user)
    events.record(session, actor(token), "token.create", spec.name, f"role {spec.role.value}")
    return TokenCreated(**svc.token_public(session, row).model_dump(), token=secret)


@router.delete("/{token_id}", response_model=TokenPublic)
def revoke_token(token_id: RowId, session: SessionDep, token: Admin) -> TokenPublic:
    row = svc.revoke(session, token_id, token)
    events.record(session, actor(token), "token.revoke", row.name)
    return svc.token_public(session, row)


users = APIRouter(prefix="/users", tags=["users"])


@users.get("", response_model=list[UserPublic])
def list_users(session: SessionDep, _t: Admin) -> list[UserPublic]:
    return svc.list_users(session)


@users.post("", response_model=UserPublic, status_code=status.HTTP_201_CREATED)
def create_user(spec: UserCreate, session: SessionDep, token: Admin) -> UserPublic:
    user = svc.create_user(session, spec)
    events.record(session, actor(token), "user.create", user.name, f"role {user.role}")
    return UserPublic(name=user.name, role=user.role, full_name=user.full_name, created_at=user.created_at)


@users.delete("/{name}")
def delete_user(name: Name, session: SessionDep, token: Admin) -> dict[str, str]:
    svc.delete_user(session, name, token)
    events.record(session, actor(token), "user.delete", name, "their tokens are revoked")
    return {"deleted": name}
