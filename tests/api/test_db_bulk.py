"""bcm.db_bulk.write_rows against the real databases (SQLite and PostgreSQL): what goes in comes back with
its types — timestamps (naive ones are UTC), JSON columns, floats, big counters, NULLs, text that needs
quoting — several tables in one call, and an upsert replaces every column but the key."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import Engine
from sqlmodel import Session

from bcm.db_bulk import write_rows
from bcm.models.health import GpuHealth, HealthRecord, NodeHealth


def a_node(engine: Engine, api: Any) -> int:
    r = api.post("/api/v1/nodes", json={"name": "bulk01"})
    assert r.status_code == 201, r.text
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT id FROM node WHERE name = 'bulk01'")).scalar_one())


def test_rows_come_back_with_their_types(api: Any, engine: Engine) -> None:
    node = a_node(engine, api)
    aware = datetime(2026, 12, 4, 3, 0, 1, 123456, tzinfo=timezone(timedelta(hours=2)))
    naive = datetime(2026, 12, 4, 1, 0, 2)
    gpus = [
        [0, "GPU-a'b\"c\\d", "OK", 41, 312.75, 99, 80_000, 2**62, 0, None],
        [1, "GPU-ü", "FAIL", None, None, None, None, None, None, 79],
    ]
    records = [
        {"node_id": node, "time": aware, "gpus": gpus},
        {"node_id": node, "time": naive, "gpus": gpus[1:]},
    ]
    findings = [{"code": "xid", "detail": {"xid": 79, "text": "fell off the bus"}}]
    health = [
        {
            "node_id": node,
            "verdict": "FAIL",
            "findings": findings,
            "last_report_at": naive,
            "updated_at": aware,
            "consecutive_ok": 0,
            "gpu_count": 2,
            "drained_by_bcm": True,
            "action_attempts": 0,
            "samples_since_prune": 2,
        }
    ]
    with engine.begin() as conn:
        write_rows(conn, [(NodeHealth, health, True), (HealthRecord, records, False)])
    with Session(engine) as s:
        got = s.exec(select(HealthRecord).order_by(HealthRecord.id)).scalars().all()  # type: ignore[call-overload]
        assert [g.gpus for g in got] == [gpus, gpus[1:]]  # JSON: quotes, backslashes, 2**62, floats, None
        assert got[0].time == aware and got[0].time.utcoffset() is not None
        assert got[1].time == naive.replace(tzinfo=UTC)
        nh = s.get(NodeHealth, node)
        assert (
            nh is not None and nh.findings == findings and nh.verdict == "FAIL" and nh.drained_by_bcm is True
        )
        assert nh.last_report_at == naive.replace(tzinfo=UTC)


def test_upsert_replaces_every_column_but_the_key(api: Any, engine: Engine) -> None:
    node = a_node(engine, api)
    now = datetime.now(UTC)

    def gpus(verdict: str, reasons: Any) -> list[dict[str, Any]]:
        return [
            {
                "node_id": node,
                "index": i,
                "uuid": f"GPU-{i}",
                "verdict": verdict,
                "reasons": reasons,
                "xid_count": 0,
                "sampled_at": now,
            }
            for i in range(3)
        ]

    with engine.begin() as conn:
        write_rows(conn, [(GpuHealth, gpus("OK", None), True)])
    with engine.begin() as conn:
        write_rows(conn, [(GpuHealth, gpus("WARN", [{"code": "temp"}]), True)])
    with Session(engine) as s:
        rows = s.exec(select(GpuHealth).order_by(GpuHealth.index)).scalars().all()  # type: ignore[call-overload]
        assert [(r.index, r.verdict, r.reasons) for r in rows] == [
            (i, "WARN", [{"code": "temp"}]) for i in range(3)
        ]


def test_nothing_to_write_is_no_statement(engine: Engine) -> None:
    with engine.begin() as conn:
        write_rows(conn, [(HealthRecord, [], False)])  # no rows: nothing sent, nothing fails


def test_postgresql_sessions_run_in_utc(engine: Engine) -> None:
    """A naive timestamp in a bulk write is read as UTC on PostgreSQL whatever the server's own zone."""
    if engine.dialect.name != "postgresql":
        pytest.skip("PostgreSQL only: SQLite has no session time zone")
    with engine.connect() as conn:
        conn.exec_driver_sql("SET TimeZone = 'Asia/Kolkata'")  # a pooled connection that was changed
        conn.rollback()
    engine.dispose()  # fresh connections: each is set up by make_engine again
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SHOW TimeZone").scalar() == "UTC"
