"""Migration 0020_install (#30): the install columns come as the models declare them (existing nodes stay
stateless, no data node), and go on downgrade leaving the rows."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text
from sqlmodel import SQLModel

import bcm.models  # noqa: F401 - every table on SQLModel.metadata
from bcm.db import alembic_config

BEFORE, AFTER = "0019_wlm_usage", "0020_install"
NOW = "2026-01-01 00:00:00+00:00"
COLUMNS = {
    "install_mode",
    "next_install_mode",
    "data_node",
    "wipe_confirmed",
    "install_state",
    "installed_image",
    "installed_layout",
    "installed_at",
    "install_bytes",
    "booted_image",
    "booted_from",
}


def test_install_columns_come_as_modelled_and_go(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, BEFORE)
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(
            text("INSERT INTO category (name, created_at, bmc_allow_http) VALUES ('gpu', :t, false)"),
            {"t": NOW},
        )
        conn.execute(
            text(
                "INSERT INTO node (name, provision_state, created_at, updated_at) VALUES ('n01', 'booted', :t, :t)"
            ),
            {"t": NOW},
        )
    engine.dispose()
    command.upgrade(cfg, AFTER)
    engine = create_engine(db_url)
    with engine.begin() as conn:
        row = conn.execute(
            text("SELECT install_mode, data_node, wipe_confirmed, install_state FROM node")
        ).one()
        assert tuple(row) == (None, False, False, None)
        assert conn.execute(text("SELECT install_mode, disk_layout FROM category")).one() == (None, None)
        diffs = compare_metadata(MigrationContext.configure(conn), SQLModel.metadata)
    engine.dispose()
    mine = [d for d in diffs if any(c in str(d) for c in COLUMNS | {"disk_layout"})]
    assert mine == [], mine

    command.downgrade(cfg, BEFORE)
    engine = create_engine(db_url)
    try:
        assert not COLUMNS & {c["name"] for c in inspect(engine).get_columns("node")}
        assert "disk_layout" not in {c["name"] for c in inspect(engine).get_columns("category")}
        with engine.connect() as conn:
            assert conn.execute(text("SELECT name FROM node")).scalar() == "n01"
    finally:
        engine.dispose()
