"""Query and path parameters shared by the routers, bounded by what the database columns hold."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query

from bcm.models.base import INT32_MAX, Timestamp

Offset = Annotated[int, Query(ge=0, le=INT32_MAX)]
Since = Annotated[Timestamp | None, Query(description="ISO 8601 time, e.g. 2026-01-31T12:00:00Z")]
RowId = Annotated[int, Path(ge=1, le=INT32_MAX)]
