"""Migration 0012_health_records: a report's per-GPU history rows become one row and come back on downgrade
(SQLite, PostgreSQL); the history API reads what the migration carried over."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from alembic import command
from sqlalchemy import create_engine, inspect, text
from sqlmodel import Session

from bcm.db import alembic_config
from bcm.services.health_queries import gpu_history

BEFORE = "0011_health_writes"
AFTER = "0012_health_records"
T1 = datetime(2026, 12, 1, 10, 0, 0, tzinfo=UTC)
T2 = datetime(2026, 12, 1, 10, 0, 30, tzinfo=UTC)
MANY = 2500

# (node_id, time, gpu_index, uuid, verdict, temperature_c, power_draw_w, ecc_sbe_volatile, xid)
SAMPLES = [
    (1, T1, 0, "GPU-a", "OK", 40, 300.5, 0, None),
    (1, T1, 1, "GPU-b", "OK", 41, 301.0, 2**40, None),
    (1, T2, 1, "GPU-b", "FAIL", None, None, None, 79),  # GPU 0 left out of this report
    (1, T2, 0, "GPU-a", "OK", 42, 299.0, 0, None),
    (2, T1, 0, "GPU-c", "WARN", 88, 700.0, 5, 13),
]


def _seed(url: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        for node_id, name in ((1, "gpu01"), (2, "gpu02")):
            conn.execute(
                text(
                    "INSERT INTO node (id, name, provision_state, created_at, updated_at)"
                    " VALUES (:id, :name, 'ready', :now, :now)"
                ),
                {"id": node_id, "name": name, "now": T1},
            )
        for node_id, t, index, uuid, verdict, temp, power, sbe, xid in SAMPLES:
            conn.execute(
                text(
                    "INSERT INTO healthsample (node_id, uuid, gpu_index, time, verdict, temperature_c,"
                    " power_draw_w, ecc_sbe_volatile, xid)"
                    " VALUES (:n, :u, :i, :t, :v, :temp, :p, :sbe, :xid)"
                ),
                {
                    "n": node_id,
                    "u": uuid,
                    "i": index,
                    "t": t,
                    "v": verdict,
                    "temp": temp,
                    "p": power,
                    "sbe": sbe,
                    "xid": xid,
                },
            )
        # past the migration's batches of 1,000: node 3 with 2,500 one-GPU reports
        conn.execute(
            text(
                "INSERT INTO node (id, name, provision_state, created_at, updated_at) VALUES (3, 'gpu03', 'ready', :t, :t)"
            ),
            {"t": T1},
        )
        conn.execute(
            text(
                "INSERT INTO healthsample (node_id, uuid, gpu_index, time, verdict) VALUES (3, 'GPU-d', 0, :t, 'OK')"
            ),
            [{"t": T1 + timedelta(seconds=i)} for i in range(MANY)],
        )
    engine.dispose()


def test_samples_become_one_record_per_report_and_split_back(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, BEFORE)
    _seed(db_url)
    command.upgrade(cfg, AFTER)

    engine = create_engine(db_url)
    assert "healthsample" not in inspect(engine).get_table_names()
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT node_id, gpus FROM healthrecord ORDER BY id")).all()
    records = [
        (n, json.loads(g) if isinstance(g, str) else g) for n, g in rows if n != 3
    ]  # SQLite: JSON text
    assert sum(1 for n, _ in rows if n == 3) == MANY
    # one record per (node, report time); GPUs in index order, values in RECORD_FIELDS order
    assert [(n, [g[:3] for g in gpus]) for n, gpus in records] == [
        (1, [[0, "GPU-a", "OK"], [1, "GPU-b", "OK"]]),
        (1, [[0, "GPU-a", "OK"], [1, "GPU-b", "FAIL"]]),
        (2, [[0, "GPU-c", "WARN"]]),
    ]
    assert records[0][1][1] == [1, "GPU-b", "OK", 41, 301.0, None, None, 2**40, None, None]
    with Session(engine) as s:
        b = gpu_history(s, "GPU-b", node="gpu01")
        assert [(x.time, x.verdict, x.xid, x.ecc_sbe_volatile) for x in b.samples] == [
            (T2, "FAIL", 79, None),
            (T1, "OK", None, 2**40),
        ]
        assert [x.temperature_c for x in gpu_history(s, "GPU-a", node="gpu01", limit=1).samples] == [42]
    engine.dispose()

    command.downgrade(cfg, BEFORE)
    engine = create_engine(db_url)
    assert "healthrecord" not in inspect(engine).get_table_names()
    with engine.connect() as conn:
        back = conn.execute(
            text(
                "SELECT node_id, gpu_index, uuid, verdict, temperature_c, power_draw_w, ecc_sbe_volatile, xid"
                " FROM healthsample WHERE node_id < 3 ORDER BY node_id, id"
            )
        ).all()
        assert conn.execute(text("SELECT count(*) FROM healthsample WHERE node_id = 3")).scalar_one() == MANY
    engine.dispose()
    want = sorted(SAMPLES, key=lambda s: (s[0], s[1], s[2]))
    assert [tuple(r) for r in back] == [
        (n, i, u, v, temp, p, sbe, x) for n, _t, i, u, v, temp, p, sbe, x in want
    ]
