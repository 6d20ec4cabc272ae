"""Migration 0009_wlm_members: hostlists become member rows and come back on downgrade (SQLite, PostgreSQL)."""

from __future__ import annotations

from alembic import command
from sqlalchemy import create_engine, inspect, text

from bcm.db import alembic_config

BEFORE = "0009_pxe"
AFTER = "0009_wlm_members"
NOW = "2026-01-01 00:00:00+00:00"


def _seed(url: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        for i, name in enumerate(["head", "gpu01", "gpu02", "gpu03", "gpu10", "cpu1", "other"], start=1):
            conn.execute(
                text(
                    "INSERT INTO node (id, name, provision_state, created_at, updated_at)"
                    " VALUES (:id, :name, 'ready', :now, :now)"
                ),
                {"id": i, "name": name, "now": NOW},
            )
        clusters = [
            (1, "alpha", 1, "gpu[01-03],gpu10,ghost01"),  # ghost01 is no node any more: dropped
            (2, "beta", 6, "cpu1,gpu02"),  # gpu02 is alpha's already: stays there; the controller is a member
        ]
        for cid, name, ctl, nodes in clusters:
            conn.execute(
                text(
                    "INSERT INTO wlm_cluster (id, name, kind, controller_id, nodes, state, created_at, updated_at)"
                    " VALUES (:id, :name, 'slurm', :ctl, :nodes, 'deployed', :now, :now)"
                ),
                {"id": cid, "name": name, "ctl": ctl, "nodes": nodes, "now": NOW},
            )
    engine.dispose()


def _members(url: str) -> set[tuple[str, str, str]]:
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT c.name, n.name, m.role FROM wlm_member m"
                " JOIN wlm_cluster c ON c.id = m.cluster_id JOIN node n ON n.id = m.node_id"
            )
        ).all()
    engine.dispose()
    return {(c, n, r) for c, n, r in rows}


def test_hostlists_become_rows_and_fold_back(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, BEFORE)
    _seed(db_url)
    command.upgrade(cfg, AFTER)

    engine = create_engine(db_url)
    assert "nodes" not in {c["name"] for c in inspect(engine).get_columns("wlm_cluster")}
    engine.dispose()
    assert _members(db_url) == {
        ("alpha", "gpu01", "compute"),
        ("alpha", "gpu02", "compute"),
        ("alpha", "gpu03", "compute"),
        ("alpha", "gpu10", "compute"),
        ("alpha", "head", "controller"),
        ("beta", "cpu1", "compute"),
    }

    # a deleted node leaves its cluster; a deleted cluster takes its rows along
    engine = create_engine(db_url)
    with engine.begin() as conn:
        if engine.dialect.name == "sqlite":
            conn.execute(text("PRAGMA foreign_keys=ON"))
        conn.execute(text("DELETE FROM node WHERE name = 'gpu03'"))
    engine.dispose()
    assert ("alpha", "gpu03", "compute") not in _members(db_url)

    command.downgrade(cfg, BEFORE)
    engine = create_engine(db_url)
    with engine.connect() as conn:
        nodes = dict(conn.execute(text("SELECT name, nodes FROM wlm_cluster")).all())
    assert "wlm_member" not in inspect(engine).get_table_names()
    engine.dispose()
    assert nodes == {"alpha": "gpu[01-02,10]", "beta": "cpu1"}
