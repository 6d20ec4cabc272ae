"""Bounds every stored value must respect, so bad input is a 422 naming the field, never a database error."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from pydantic import AfterValidator

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
EARLIEST = datetime(1970, 1, 2, tzinfo=UTC)
LATEST = datetime(9000, 1, 1, tzinfo=UTC)


def bounded_datetime(value: datetime) -> datetime:
    """A timestamp the database can store and compare: timezone-aware UTC, between 1970 and 9000."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    try:
        value = value.astimezone(UTC)
    except OverflowError:
        raise ValueError("date is out of range (1970-01-02 to 9000-01-01)") from None
    if not EARLIEST <= value <= LATEST:
        raise ValueError("date is out of range (1970-01-02 to 9000-01-01)")
    return value


Timestamp = Annotated[datetime, AfterValidator(bounded_datetime)]
