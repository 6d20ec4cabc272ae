"""API tokens: issue, verify, revoke. Only SHA-256 hashes are stored; a token is shown once."""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from sqlalchemy import func, update
from sqlmodel import Session, col, select

from bcm.errors import BcmError, Conflict, Duplicate, Forbidden, InvalidInput, NotFound, Unauthorized
from bcm.models.auth import ApiToken, Role, TokenPublic, User, UserCreate, UserPublic
from bcm.models.base import utcnow

TOKEN_PREFIX = "bcm_"  # noqa: S105 - a prefix, not a secret


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def issue(
    session: Session, name: str, role: Role, *, node_id: int | None = None, user: str | None = None
) -> tuple[ApiToken, str]:
    """Create a token; returns the row and the secret, which is never stored."""
    user_id = None
    if user is not None:
        owner = get_user(session, user)
        if role.rank > Role(owner.role).rank:
            raise InvalidInput(
                f"role: {role.value} exceeds the role of user {user!r} ({owner.role})", field="role"
            )
        user_id = owner.id
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = ApiToken(
        name=name,
        role=role.value,
        token_hash=hash_token(secret),
        prefix=secret[:10],
        node_id=node_id,
        user_id=user_id,
    )
    session.add(row)
    session.flush()
    return row, secret


def verify(session: Session, token: str | None) -> ApiToken:
    """The live token row for a bearer secret, or Unauthorized."""
    if not token:
        raise Unauthorized("missing bearer token (set BCM_TOKEN or pass --token)")
    row = session.exec(select(ApiToken).where(ApiToken.token_hash == hash_token(token))).first()
    if row is None or row.revoked_at is not None:
        raise Unauthorized("invalid or revoked token")
    return row


def node_tokens(
    session: Session, presented: Sequence[str], touch_before: datetime
) -> dict[str, ApiToken | BcmError]:
    """Many agents' bearer secrets checked at once: each live node token, or why it is refused.

    Tokens last used before ``touch_before`` get ``last_used_at`` set now (one statement for all).
    """
    hashes = {p: hash_token(p) for p in presented}
    rows = {
        r.token_hash: r
        for r in session.exec(select(ApiToken).where(col(ApiToken.token_hash).in_(set(hashes.values()))))
    }
    found: dict[str, ApiToken | BcmError] = {}
    stale: list[int] = []
    for secret, digest in hashes.items():
        row = rows.get(digest)
        if row is None or row.revoked_at is not None:
            found[secret] = Unauthorized("invalid or revoked token")
        elif row.role != Role.NODE.value or row.node_id is None:
            found[secret] = Forbidden(
                "this endpoint takes a node's agent token (issue one with `bcm node token NODE`)"
            )
        else:
            found[secret] = row
            if row.id is not None and (row.last_used_at is None or row.last_used_at < touch_before):
                stale.append(row.id)
    if stale:
        session.execute(
            update(ApiToken).where(col(ApiToken.id).in_(sorted(stale))).values(last_used_at=utcnow())
        )
    return found


def has_role(token: ApiToken, needed: Role) -> bool:
    try:
        require_role(token, needed)
    except Forbidden:
        return False
    return True


def require_role(token: ApiToken, needed: Role) -> None:
    role = Role(token.role)
    if role is Role.NODE and needed is not Role.NODE:
        raise Forbidden("a node token may only report for its own node")
    if role.rank < needed.rank:
        raise Forbidden(f"role {role.value} may not do this (needs {needed.value})")


def list_tokens(session: Session, include_revoked: bool = False) -> list[ApiToken]:
    stmt = select(ApiToken).where(col(ApiToken.node_id).is_(None))
    if not include_revoked:
        stmt = stmt.where(col(ApiToken.revoked_at).is_(None))
    return list(session.exec(stmt.order_by(col(ApiToken.id))))


def revoke(session: Session, token_id: int, caller: ApiToken | None = None) -> ApiToken:
    row = session.get(ApiToken, token_id)
    if row is None or row.node_id is not None:
        raise NotFound(f"token {token_id} not found")
    if caller is not None and row.id == caller.id:
        raise Conflict(
            "a token cannot revoke itself (that would lock its holder out); use another admin token"
        )
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.add(row)
    return row


def bootstrap_admin(session: Session, token_file: Path) -> str | None:
    """On an empty token table, make an admin token and write it 0600 to ``token_file``.

    Returns the file path written, or None when admin tokens already exist.
    """
    exists = session.exec(select(ApiToken).where(ApiToken.role == Role.ADMIN.value)).first()
    if exists is not None:
        return None
    _row, secret = issue(session, "bootstrap-admin", Role.ADMIN)
    token_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secret + "\n")
    os.chmod(token_file, 0o600)
    return str(token_file)


def get_user(session: Session, name: str) -> User:
    user = session.exec(select(User).where(User.name == name)).first()
    if user is None:
        raise NotFound(f"user {name!r} not found")
    return user


def create_user(session: Session, spec: UserCreate) -> User:
    if session.exec(select(User).where(User.name == spec.name)).first() is not None:
        raise Duplicate(f"name: user {spec.name!r} already exists", field="name")
    user = User(name=spec.name, role=spec.role.value, full_name=spec.full_name)
    session.add(user)
    session.flush()
    return user


def delete_user(session: Session, name: str, caller: ApiToken | None = None) -> None:
    """Remove a user; their tokens go with them (and stop working at once)."""
    user = get_user(session, name)
    if caller is not None and caller.user_id == user.id:
        raise Conflict(
            f"user {name!r} owns the token of this request; remove them with another admin's token"
        )
    for token in session.exec(select(ApiToken).where(ApiToken.user_id == user.id)):
        session.delete(token)
    session.delete(user)
    session.flush()


def list_users(session: Session) -> list[UserPublic]:
    counts = dict(
        session.exec(
            select(ApiToken.user_id, func.count())
            .where(col(ApiToken.revoked_at).is_(None))
            .group_by(col(ApiToken.user_id))
        ).all()  # type: ignore[arg-type]
    )
    return [
        UserPublic(
            name=u.name,
            role=u.role,
            full_name=u.full_name,
            created_at=u.created_at,
            tokens=counts.get(u.id, 0),
        )
        for u in session.exec(select(User).order_by(col(User.name)))
    ]


def token_public(session: Session, token: ApiToken) -> TokenPublic:
    owner = session.get(User, token.user_id) if token.user_id is not None else None
    return TokenPublic(
        **token.model_dump(exclude={"user_id", "token_hash", "node_id"}), user=owner.name if owner else None
    )
