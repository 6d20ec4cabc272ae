"""API tokens (stored as SHA-256 hashes) and their roles."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sqlmodel import Field, SQLModel

from bcm.models.base import ts_column, utcnow


class Role(StrEnum):
    ADMIN = "admin"
    OPERATOR = "operator"
    VIEWER = "viewer"
    NODE = "node"  # an agent's token: may write only its own node's data

    @property
    def rank(self) -> int:
        return {"node": 0, "viewer": 1, "operator": 2, "admin": 3}[self.value]


class ApiToken(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
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


class TokenPublic(SQLModel):
    id: int
    name: str
    role: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None = None
    last_used_at: datetime | None = None


class TokenCreated(TokenPublic):
    token: str  # shown once
