"""Users, API tokens (stored as SHA-256 hashes) and their roles."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import field_validator
from sqlmodel import Field, SQLModel

from bcm.domain.naming import check_name
from bcm.models.base import ts_column, utcnow


class Role(StrEnum):
    ADMIN = "admin"
    OPERATOR = "operator"
    VIEWER = "viewer"
    USER = "user"  # no system-wide rights: only what department-admin / project-member bindings give
    NODE = "node"  # an agent's token: may write only its own node's data

    @property
    def rank(self) -> int:
        return {"node": 0, "user": 1, "viewer": 2, "operator": 3, "admin": 4}[self.value]


class User(SQLModel, table=True):
    """A person (or robot) who holds tokens; a token never has more rights than its user."""

    __tablename__ = "users"  # "user" is reserved in PostgreSQL

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=63, unique=True, index=True)
    role: str = Field(max_length=16)
    full_name: str | None = Field(default=None, max_length=128)
    created_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))


class UserCreate(SQLModel):
    name: str = Field(max_length=63)
    role: Role = Role.VIEWER
    full_name: str | None = Field(default=None, max_length=128)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v)

    @field_validator("role")
    @classmethod
    def _role(cls, v: Role) -> Role:
        if v is Role.NODE:
            raise ValueError("node is not a role for people; nodes get agent tokens")
        return v


class UserPublic(SQLModel):
    name: str
    role: str
    full_name: str | None = None
    created_at: datetime
    tokens: int = 0


class ApiToken(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    user_id: int | None = Field(default=None, foreign_key="users.id", index=True, ondelete="CASCADE")
    name: str = Field(max_length=128)
    role: str = Field(max_length=16)
    token_hash: str = Field(max_length=64, unique=True, index=True)
    prefix: str = Field(max_length=16)
    node_id: int | None = Field(default=None, foreign_key="node.id", index=True, ondelete="CASCADE")
    created_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))
    revoked_at: datetime | None = Field(default=None, sa_column=ts_column())
    last_used_at: datetime | None = Field(default=None, sa_column=ts_column())


class TokenCreate(SQLModel):
    name: str = Field(min_length=1, max_length=128)
    role: Role = Role.VIEWER
    user: str | None = Field(default=None, max_length=63, description="owner; the role may not exceed theirs")


class TokenPublic(SQLModel):
    id: int
    name: str
    role: str
    user: str | None = None
    prefix: str
    created_at: datetime
    revoked_at: datetime | None = None
    last_used_at: datetime | None = None


class TokenCreated(TokenPublic):
    token: str  # shown once
