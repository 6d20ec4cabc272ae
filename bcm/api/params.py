"""Query and path parameters shared by the routers, bounded by what the database columns hold."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import Path, Query
from pydantic import BeforeValidator

from bcm.domain.bounds import EARLIEST, INT32_MAX, LATEST

Offset = Annotated[int, Query(ge=0, le=INT32_MAX)]
RowId = Annotated[int, Path(ge=1, le=INT32_MAX)]
# names in paths: the same rule as stored names (RFC 1123 label), so odd input never reaches a query
NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
Name = Annotated[str, Path(pattern=NAME_PATTERN, max_length=63)]
# a verb in a path (drain, power-cycle …): the route names the one it does not know, with the choices
Verb = Annotated[str, Path(pattern=r"^[a-z][a-z-]{0,31}$", max_length=32)]
# a workload-manager cluster: Slurm's rule ('_') or Kubernetes' ('-'), both at most 40
ClusterName = Annotated[str, Path(pattern=r"^[a-z][a-z0-9_-]{0,39}$", max_length=40)]
# a name as a query-string filter (e.g. ?department=): the same rule, so a NUL never reaches a query
NameQuery = Annotated[str | None, Query(pattern=NAME_PATTERN, max_length=63)]
# a hostlist in a query string: short enough for any HTTP server's request line (POST bodies take more)
# (the characters of the hostlist grammar only: bcm.domain.naming refuses anything else, `@group` included)
HOSTLIST_PATTERN = r"^[A-Za-z0-9_.,/\[\]-]+$"
HostlistQuery = Annotated[
    str | None,
    Query(min_length=1, max_length=8192, pattern=HOSTLIST_PATTERN, description="hostlist, e.g. gpu[01-16]"),
]


# free text in a query string: no control characters (NUL reaches no database; escapes reach terminals)
PRINTABLE_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]*$"


def text_query(max_length: int, description: str | None = None) -> Any:
    """A string filter in a query string, bounded by its column and free of control characters."""
    return Query(max_length=max_length, pattern=PRINTABLE_PATTERN, description=description)


def _since(value: object) -> object:
    """An ISO 8601 time only (not a bare number); a filter's time is clamped to what the database stores."""
    if value is None:
        return None
    if not isinstance(value, str) or "-" not in value or len(value) > 64:
        raise ValueError("give an ISO 8601 time, e.g. 2026-01-31T12:00:00Z")
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError("give an ISO 8601 time, e.g. 2026-01-31T12:00:00Z") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=EARLIEST.tzinfo)
    try:
        return min(max(parsed, EARLIEST), LATEST)
    except OverflowError:  # a zone offset pushing past year 1 or 9999
        return EARLIEST if parsed.year < 5000 else LATEST


Since = Annotated[
    datetime | None,
    BeforeValidator(_since),
    Query(description="ISO 8601 time, e.g. 2026-01-31T12:00:00Z (earlier or later times are clamped)"),
]
