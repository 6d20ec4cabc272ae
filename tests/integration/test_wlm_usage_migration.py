"""Migration 0019_wlm_usage on SQLite and PostgreSQL: the usage table and ``wlm_cluster.usage_at`` come as
the models declare them, and go on downgrade leaving the cluster row."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text
from sqlmodel import SQLModel

import bcm.models  # noqa: F401 - every table on SQLModel.metadata
from bcm.db import alembic_config

BEFORE, AFTER = "0018_zero_touch", "0019_wlm_usage"
NOW = "2026-01-01 00:00:00+00:00"


def test_usage_table_comes_as_modelled_and_goes(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, BEFORE)
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO node (id, name, provision_state, created_at, updated_at)"
                " VALUES (1, 'gpu01', 'ready', :now, :now)"
            ),
            {"now": NOW},
        )
        conn.execute(
            text(
                "INSERT INTO wlm_cluster (id, name, kind, controller_id, state, created_at, updated_at)"
                " VALUES (1, 'lab', 'slurm', 1, 'deployed', :now, :now)"
            ),
            {"now": NOW},
        )
    engine.dispose()

    command.upgrade(cfg, AFTER)
    engine = create_engine(db_url)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT usage_at FROM wlm_cluster")).scalar() is None
        conn.execute(
            text(
                "INSERT INTO wlm_usage (cluster_id, node_id, account, gpus, jobs) VALUES (1, 1, 'nlp', 4, 1)"
            )
        )
        diffs = compare_metadata(MigrationContext.configure(conn), SQLModel.metadata)
    engine.dispose()
    mine = [d for d in diffs if "wlm_usage" in str(d) or "usage_at" in str(d)]
    assert mine == [], mine

    command.downgrade(cfg, BEFORE)
    engine = create_engine(db_url)
    try:
        assert "wlm_usage" not in inspect(engine).get_table_names()
        assert "usage_at" not in {c["name"] for c in inspect(engine).get_columns("wlm_cluster")}
        with engine.connect() as conn:
            assert conn.execute(text("SELECT name FROM wlm_cluster")).scalar() == "lab"
    finally:
        engine.dispose()
