"""Many rows into several tables in as few statements as the backend allows.

On PostgreSQL every write is ``INSERT … SELECT FROM unnest(<one array parameter per column>)`` (short,
prepared once, any row count), and all of them are data-modifying CTEs of one statement: one round
trip. On SQLite (in-process, no round trips) each is one cached Core ``executemany``. Upserts update
every column but the primary key. Callers pass rows of one shape per table, sorted by primary key
(writers that take their rows in one order do not deadlock one another), and at most one row per key
for an upsert (PostgreSQL refuses to update a row twice in one statement).
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy.engine import Connection

Write = tuple[Any, list[dict[str, Any]], bool]  # (SQLModel table class, rows of one shape, upsert)

_STATEMENTS: dict[tuple[Any, ...], Any] = {}
_PG_ARRAY_TYPES = {
    "INTEGER": "int4", "BIGINT": "int8", "BIGINTEGER": "int8", "FLOAT": "float8", "BOOLEAN": "bool", "JSON": "json",
}  # fmt: skip


def write_rows(conn: Connection, writes: list[Write]) -> None:
    """All of ``writes``: one statement on PostgreSQL, one executemany per table on SQLite."""
    writes = [w for w in writes if w[1]]
    if not writes:
        return
    if conn.dialect.name == "postgresql":
        key = ("pg", tuple((w[0].__name__, tuple(w[1][0]), w[2]) for w in writes))
        if key not in _STATEMENTS:
            parts = [_pg_insert_sql(m, tuple(rows[0]), up, f"w{i}_") for i, (m, rows, up) in enumerate(writes)]
            ctes = ", ".join(f"w{i} AS ({sql} RETURNING 1)" for i, sql in enumerate(parts[:-1]))
            _STATEMENTS[key] = (f"WITH {ctes} " if ctes else "") + parts[-1]
        params: dict[str, Any] = {}
        for i, (model, rows, _up) in enumerate(writes):
            table: Any = model.__table__
            for k in rows[0]:
                as_json = _pg_array_type(table.c[k]) == "json"
                params[f"w{i}_{k}"] = [json.dumps(r[k]) if as_json and r[k] is not None else r[k] for r in rows]
        conn.exec_driver_sql(_STATEMENTS[key], params)
        return
    for model, rows, upsert in writes:
        conn.execute(_sqlite_statement(model, tuple(rows[0]), upsert), rows)


def _pg_array_type(column: Any) -> str:
    name = type(column.type).__name__.upper()
    if name == "UTCDATETIME":
        return "timestamptz"
    return _PG_ARRAY_TYPES.get(name, "text")


def _pg_insert_sql(model: Any, keys: tuple[str, ...], upsert: bool, prefix: str) -> str:
    table: Any = model.__table__
    pk = [c.name for c in table.primary_key.columns]
    cols = ", ".join(f'"{k}"' for k in keys)
    arrays = ", ".join(f"%({prefix}{k})s::{_pg_array_type(table.c[k])}[]" for k in keys)
    sql = f"INSERT INTO {table.name} ({cols}) SELECT * FROM unnest({arrays})"  # noqa: S608 - our own names
    if upsert:
        sets = ", ".join(f'"{k}" = EXCLUDED."{k}"' for k in keys if k not in pk)
        sql += f" ON CONFLICT ({', '.join(pk)}) DO UPDATE SET {sets}"
    return sql


def _sqlite_statement(model: Any, keys: tuple[str, ...], upsert: bool) -> Any:
    table: Any = model.__table__
    key = ("sqlite", table.name, keys, upsert)
    if key not in _STATEMENTS:
        from sqlalchemy.dialects import sqlite

        stmt: Any = sqlite.insert(table)
        if upsert:
            pk = [c.name for c in table.primary_key.columns]
            stmt = stmt.on_conflict_do_update(
                index_elements=pk, set_={k: stmt.excluded[k] for k in keys if k not in pk}
            )
        _STATEMENTS[key] = stmt
    return _STATEMENTS[key]
