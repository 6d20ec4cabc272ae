"""How `bcm backup`/`restore` hand a PostgreSQL URL to pg_dump and pg_restore: every connection parameter in
libpq's environment, the password in PGPASSWORD only (never on a command line, never in what is shown)."""

from __future__ import annotations

from bcm.backup import pg_target


def test_a_plain_url_becomes_libpq_variables() -> None:
    t = pg_target("postgresql+psycopg://bcm:s3cr%40t@db.example:6432/bcm?sslmode=verify-full")
    assert t.env == {
        "PGCONNECT_TIMEOUT": "10",
        "PGHOST": "db.example",
        "PGPORT": "6432",
        "PGUSER": "bcm",
        "PGPASSWORD": "s3cr@t",
        "PGDATABASE": "bcm",
        "PGSSLMODE": "verify-full",
    }
    assert t.schema is None and "s3cr" not in t.display


def test_several_hosts_and_a_search_path() -> None:
    t = pg_target(
        "postgresql+psycopg://bcm@/bcm?host=db1:5432&host=db2:5433&target_session_attrs=read-write"
        "&options=-csearch_path%3Dbcm_site"
    )
    assert t.env["PGHOST"] == "db1,db2" and t.env["PGPORT"] == "5432,5433"
    assert t.env["PGTARGETSESSIONATTRS"] == "read-write"
    assert t.schema == "bcm_site" and "PGPASSWORD" not in t.env
