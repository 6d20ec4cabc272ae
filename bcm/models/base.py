"""Shared column helpers for the SQLModel tables."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, Column, DateTime
from sqlalchemy.types import TypeDecorator

from bcm.domain.bounds import INT32_MAX, INT64_MAX, Timestamp, bounded_datetime

__all__ = ["INT32_MAX", "INT64_MAX", "Timestamp", "bounded_datetime", "json_column", "ts_column", "utcnow"]


def utcnow() -> datetime:
    return datetime.now(UTC)


class UtcDateTime(TypeDecorator[datetime]):
    """Timestamps stored in UTC and always read back timezone-aware (SQLite drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


def ts_column(*, nullable: bool = True, index: bool = False) -> Any:
    """A timezone-aware UTC timestamp column."""
    return Column(UtcDateTime(), nullable=nullable, index=index)


def json_column(*, nullable: bool = True) -> Any:
    return Column(JSON, nullable=nullable)
