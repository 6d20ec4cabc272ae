"""Images: a base OS plus driver/toolkit/WLM layers (placeholder until image building lands)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import UniqueConstraint
from sqlmodel import Field, SQLModel

from bcm.models.base import ts_column, utcnow


class Image(SQLModel, table=True):
    __table_args__ = (UniqueConstraint("name", "version"),)

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, max_length=128)
    version: str = Field(default="1", max_length=64)
    state: str = Field(default="building", max_length=16)
    recipe: str | None = Field(default=None, max_length=256)
    driver_version: str | None = Field(default=None, max_length=64)
    cuda_version: str | None = Field(default=None, max_length=64)
    created_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))
