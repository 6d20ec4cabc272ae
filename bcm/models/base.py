"""Shared column helpers for the SQLModel tables."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, Column, DateTime


def utcnow() -> datetime:
    return datetime.now(UTC)


def ts_column(*, nullable: bool = True, index: bool = False) -> Any:
    """A timezone-aware timestamp column (naive values from SQLite are read back as UTC)."""
    return Column(DateTime(timezone=True), nullable=nullable, index=index)


def json_column(*, nullable: bool = True) -> Any:
    return Column(JSON, nullable=nullable)
