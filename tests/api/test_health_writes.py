"""What a health report costs the database (SQLite and PostgreSQL): a node's second report updates its
GPU and node health rows in place — on PostgreSQL as heap-only tuples, with no index entry written — no
index is kept that another one already covers (migration 0011), and a report's history is one row,
whatever its GPU count (migration 0012)."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine
from sqlmodel import Session

from bcm.db import session_scope
from bcm.domain.health_report import HealthReport
from bcm.services.health import ingest_many
from tests.api.test_health_api import add_nodes, report

NODES = 64  # enough rows to fill many pages: an update of a full page cannot stay on it


def test_no_index_is_written_twice_or_on_every_report(engine: Engine) -> None:
    indexes = {
        t: [i["column_names"] for i in inspect(engine).get_indexes(t)] for t in ("healthrecord", "nodehealth")
    }
    assert indexes["healthrecord"] == [["node_id", "id"]]  # the history, the pruning, a node's deletion
    assert "healthsample" not in inspect(engine).get_table_names()  # one row per GPU and report: gone
    assert not [cols for cols in indexes["nodehealth"] if "last_report_at" in cols]  # every report changes it


def test_a_second_report_updates_health_rows_in_place(api: Any, engine: Engine, settings: Any) -> None:
    add_nodes(api, engine, f"gpu[001-{NODES:03d}]")
    with engine.connect() as conn:
        ids = {str(n): int(i) for n, i in conn.execute(text("SELECT name, id FROM node"))}
    reports = [(ids[name], HealthReport.model_validate(report(name))) for name in sorted(ids)]
    gpus = len(reports[0][1].gpus)
    with session_scope(engine) as s:
        ingest_many(s, reports, settings.health)  # the rows are created
    with Session(engine) as s, s.begin():
        results = ingest_many(s, reports, settings.health)  # the same reports again: every row updated
        assert [r.verdict for r in results] == ["OK"] * NODES  # type: ignore[union-attr]
        history = [
            (n, json.loads(g) if isinstance(g, str) else g)  # SQLite: JSON text
            for n, g in s.execute(text("SELECT node_id, gpus FROM healthrecord"))
        ]
        assert len(history) == 2 * NODES  # one row per report, each with every GPU's reading
        assert all([r[0] for r in readings] == list(range(gpus)) for _, readings in history)
        if engine.dialect.name != "postgresql":
            return  # SQLite updates rows where they are
        counts = {
            name: (int(upd), int(hot))
            for name, upd, hot in s.execute(
                text(
                    "SELECT relname, n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables"
                    " WHERE schemaname = current_schema() AND relname IN ('gpuhealth', 'nodehealth')"
                )
            )
        }
    assert counts["gpuhealth"][0] == NODES * gpus and counts["nodehealth"][0] == NODES, counts
    # heap-only: the page had room and no indexed column changed (a few pages may still be full)
    assert counts["gpuhealth"][1] >= 0.9 * NODES * gpus, counts
    assert counts["nodehealth"][1] >= 0.9 * NODES, counts
