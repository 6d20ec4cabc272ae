"""Many rows into several tables in as few statements as the backend allows.

On PostgreSQL every write is ``INSERT … SELECT FROM json_populate_recordset(NULL::<table>, <one JSON
text>)``: short, prepared once, any row count; the rows travel as one JSON document that pydantic-core
writes in Rust and PostgreSQL converts to the columns' own types (an array parameter per
column cost more in the driver's per-element dumping than the database spent on the rows). All the
writes are data-modifying CTEs of one statement: one round trip. On SQLite (in-process, no round trips) each is one cached Core ``executemany``. Upserts update
every column but the primary key. Callers pass rows of one shape per table, sorted by primary key
(writers that take their rows in one order do not deadlock one another), and at most one row per key
for an upsert (PostgreSQL refuses to update a row twice in one statement).
"""

from __future__ import annotations

from typing import Any

import pydantic_core
from sqlalchemy.engine import Connection

Write = tuple[Any, list[dict[str, Any]], bool]  # (SQLModel table class, rows of one shape, upsert)

_STATEMENTS: dict[tuple[Any, ...], Any] = {}


def write_rows(conn: Connection, writes: list[Write]) -> None:
    """All of ``writes``: one statement on PostgreSQL, one executemany per table on SQLite."""
    writes = [w for w in writes if w[1]]
    if not writes:
        return
    if conn.dialect.name == "postgresql":
        key = ("pg", tuple((w[0].__name__, tuple(w[1][0]), w[2]) for w in writes))
        if key not in _STATEMENTS:
            parts = [_pg_insert_sql(m, tuple(rows[0]), up, f"w{i}") for i, (m, rows, up) in enumerate(writes)]
            ctes = ", ".join(f"w{i} AS ({sql} RETURNING 1)" for i, sql in enumerate(parts[:-1]))
            _STATEMENTS[key] = (f"WITH {ctes} " if ctes else "") + parts[-1]
        # encoded in Rust (a quarter of json.dumps's time at 1,000 reports/s); timestamps as ISO 8601, a
        # naive one read as UTC because every bcm session on PostgreSQL runs in UTC (bcm.db.make_engine)
        params = {f"w{i}": pydantic_core.to_json(rows).decode() for i, (_m, rows, _up) in enumerate(writes)}
        conn.exec_driver_sql(_STATEMENTS[key], params)
        return
    for model, rows, upsert in writes:
        conn.execute(_sqlite_statement(model, tuple(rows[0]), upsert), rows)


def _pg_insert_sql(model: Any, keys: tuple[str, ...], upsert: bool, param: str) -> str:
    table: Any = model.__table__
    pk = [c.name for c in table.primary_key.columns]
    cols = ", ".join(f'"{k}"' for k in keys)
    rows = f'json_populate_recordset(NULL::"{table.name}", %({param})s::json)'
    sql = f"INSERT INTO {table.name} ({cols}) SELECT {cols} FROM {rows}"  # noqa: S608 - our own names
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
