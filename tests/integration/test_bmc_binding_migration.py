"""Migration 0013_bmc_binding on SQLite and PostgreSQL: the binding, pin and http columns come and go, and a
password stored before it has no binding (so it stays unused until an admin sets it again)."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text
from sqlmodel import SQLModel

import bcm.models  # noqa: F401 - every table on SQLModel.metadata
from bcm.db import alembic_config

BEFORE, AFTER = "0012_health_records", "0013_bmc_binding"
NOW = "2026-01-01 00:00:00+00:00"
NODE_COLUMNS = {"bmc_password_target", "bmc_tls_pin"}
CATEGORY_COLUMNS = {"bmc_password_targets", "bmc_allow_http"}


def _columns(url: str, table: str) -> set[str]:
    engine = create_engine(url)
    try:
        return {c["name"] for c in inspect(engine).get_columns(table)}
    finally:
        engine.dispose()


def test_columns_come_and_go_and_old_passwords_stay_unbound(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, BEFORE)
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO category (id, name, created_at, bmc_password_enc) VALUES (1, 'r', :now, 'enc-c')"
            ),
            {"now": NOW},
        )
        conn.execute(
            text(
                "INSERT INTO node (id, name, category_id, provision_state, created_at, updated_at, bmc_address,"
                " bmc_protocol, bmc_password_enc) VALUES (1, 'n1', 1, 'ready', :now, :now, '10.0.0.5', 'ipmi', 'enc')"
            ),
            {"now": NOW},
        )
    engine.dispose()

    command.upgrade(cfg, AFTER)
    assert _columns(db_url, "node") >= NODE_COLUMNS and _columns(db_url, "category") >= CATEGORY_COLUMNS
    engine = create_engine(db_url)
    with engine.connect() as conn:
        node = conn.execute(text("SELECT bmc_password_enc, bmc_password_target, bmc_tls_pin FROM node")).one()
        cat = conn.execute(text("SELECT bmc_password_targets, bmc_allow_http FROM category")).one()
        assert tuple(node) == ("enc", None, None)
        assert cat[0] is None and not cat[1]
    engine.dispose()

    command.upgrade(cfg, "head")
    engine = create_engine(db_url)
    with engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn), SQLModel.metadata)
    engine.dispose()
    mine = NODE_COLUMNS | CATEGORY_COLUMNS
    assert [d for d in diffs if mine & set(str(d).replace("'", " ").replace(",", " ").split())] == []

    command.downgrade(cfg, BEFORE)
    assert not NODE_COLUMNS & _columns(db_url, "node") and not CATEGORY_COLUMNS & _columns(db_url, "category")
    engine = create_engine(db_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT bmc_password_enc FROM node")).scalar() == "enc"
    engine.dispose()
