"""Database failures translated into bcm errors, in one place for every edge (HTTP, background jobs).

=================================================  ==============================================
What the database said                              bcm error (HTTP status)
=================================================  ==============================================
cannot connect, connection lost, server shutting    Unavailable (503 + Retry-After)
down, busy/locked, statement or lock timeout,
deadlock, pool exhausted, too many connections
serialization failure, a row changed under us       Stale (409)
unique violation                                    Duplicate (409) naming the field
foreign-key violation                               Conflict (409) naming the constraint
not-null / check violation                          InvalidInput (422) naming the field
disk full                                           StorageFull (507)
anything else (a bug)                               BcmError (500), JSON like every other error
=================================================  ==============================================

Messages never carry SQL parameters: they may hold tokens or passwords.
"""

from __future__ import annotations

import errno
import re
import sqlite3
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy.orm.exc import StaleDataError

from bcm.errors import BcmError, Conflict, Duplicate, InvalidInput, Stale, StorageFull, Unavailable

RETRY_AFTER_S = 2

# SQLite primary result codes (https://sqlite.org/rescode.html)
_SQLITE_UNAVAILABLE = {
    sqlite3.SQLITE_BUSY,
    sqlite3.SQLITE_LOCKED,
    sqlite3.SQLITE_READONLY,
    sqlite3.SQLITE_CANTOPEN,
    sqlite3.SQLITE_PROTOCOL,
    sqlite3.SQLITE_SCHEMA,
}
_SQLITE_FULL = {sqlite3.SQLITE_FULL}
# PostgreSQL SQLSTATEs (https://www.postgresql.org/docs/current/errcodes-appendix.html)
_PG_UNAVAILABLE_PREFIXES = ("08", "53", "57P", "58")  # connection, resources, operator intervention, system
_PG_UNAVAILABLE = {"57014", "55P03", "40P01", "55006"}  # statement timeout, lock timeout, deadlock, in use
_PG_STALE = {"40001"}
_PG_FULL = {"53100"}

_SQLITE_UNIQUE = re.compile(r"UNIQUE constraint failed: ([\w.]+)")
_SQLITE_NOT_NULL = re.compile(r"NOT NULL constraint failed: ([\w.]+)")
_PG_KEY = re.compile(r"Key \(([^)]+)\)")


def unavailable(what: str) -> Unavailable:
    return Unavailable(f"{what}; retry in a few seconds", retry_after=RETRY_AFTER_S)


def translate(exc: BaseException) -> BcmError | None:
    """The bcm error for a database failure (or a full disk), or None if ``exc`` is neither."""
    if isinstance(exc, BcmError):
        return exc
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return _full()
    if isinstance(exc, StaleDataError):
        return Stale("the object changed or was removed by another request; read it again and retry")
    if isinstance(exc, sa_exc.TimeoutError):  # no pooled connection free in time
        return unavailable("the database is busy (no free connection)")
    if isinstance(exc, sa_exc.DisconnectionError):
        return unavailable("the database connection was lost")
    if not isinstance(exc, sa_exc.DBAPIError):
        return BcmError("database error") if isinstance(exc, sa_exc.SQLAlchemyError) else None
    orig = exc.orig
    if isinstance(orig, sqlite3.Error):
        return _sqlite(exc, orig)
    return _postgresql(exc, orig)


def _full() -> StorageFull:
    return StorageFull(
        "the server's disk is full: nothing was written; free space and retry (reads still work)"
    )


def _sqlite(exc: sa_exc.DBAPIError, orig: sqlite3.Error) -> BcmError:
    code = getattr(orig, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    text = str(orig)
    if primary in _SQLITE_FULL or "disk is full" in text:
        return _full()
    if isinstance(exc, sa_exc.IntegrityError):
        if m := _SQLITE_UNIQUE.search(text):
            return _duplicate(m.group(1).split(",")[0].rsplit(".", 1)[-1])
        if m := _SQLITE_NOT_NULL.search(text):
            field = m.group(1).rsplit(".", 1)[-1]
            return InvalidInput(f"{field}: a value is required", field=field)
        if "FOREIGN KEY" in text:
            return _foreign_key(None)
        return Conflict("the change breaks a database constraint; nothing was stored")
    if primary in _SQLITE_UNAVAILABLE or "locked" in text:
        return unavailable("the database is busy")
    if primary == sqlite3.SQLITE_IOERR:
        return unavailable("the database could not read or write its files")
    return BcmError("database error")


def _postgresql(exc: sa_exc.DBAPIError, orig: Any) -> BcmError:
    state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    diag = getattr(orig, "diag", None)
    if state in _PG_FULL:
        return _full()
    if state in _PG_STALE:
        return Stale("another request changed the same rows at the same time; retry")
    if state == "23505":
        m = _PG_KEY.search(getattr(diag, "message_detail", None) or "")
        return _duplicate(m.group(1).split(",")[0].strip() if m else None)
    if state == "23503":
        return _foreign_key(getattr(diag, "constraint_name", None))
    if state in ("23502", "23514"):
        field = getattr(diag, "column_name", None) or getattr(diag, "constraint_name", None) or "body"
        return InvalidInput(f"{field}: value refused by the database", field=field)
    if isinstance(exc, sa_exc.IntegrityError):
        return Conflict("the change breaks a database constraint; nothing was stored")
    if (
        exc.connection_invalidated
        or (state is None and isinstance(exc, sa_exc.OperationalError))  # refused, reset, closed
        or state in _PG_UNAVAILABLE
        or str(state).startswith(_PG_UNAVAILABLE_PREFIXES)
        or isinstance(exc, sa_exc.InterfaceError)
    ):
        return unavailable("the database is unavailable")
    return BcmError("database error")


def _duplicate(field: str | None) -> Duplicate:
    if field is None:
        return Duplicate("a unique value is already in use")
    return Duplicate(f"{field}: already in use", field=field)


def _foreign_key(constraint: str | None) -> Conflict:
    which = f" ({constraint})" if constraint else ""
    return Conflict(
        f"the change refers to an object that does not exist, or removes one still in use{which};"
        " nothing was stored"
    )
