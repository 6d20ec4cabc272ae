"""kill -9 during first-start migrations on SQLite: the schema is all or nothing, the next start works."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

from bcm.db import alembic_config
from bcm.devserver import BCM, REPO, Server

REVISIONS = [
    r.revision
    for r in reversed(list(ScriptDirectory.from_config(alembic_config("sqlite://")).walk_revisions()))
]


def _kill_when_logged(srv: Server, line: str, log: Path) -> None:
    srv.state_dir.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*BCM, "serve"], env=srv.env(), cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 60
        while line not in log.read_text():
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, f"never logged {line!r}: {log.read_text()[-2000:]}"
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize("step", [REVISIONS[0], REVISIONS[len(REVISIONS) // 2], REVISIONS[-1]])
def test_kill_9_during_first_start_migrations(tmp_path: Path, step: str) -> None:
    srv = Server(tmp_path / "state")
    _kill_when_logged(srv, f"applying migration {step}", tmp_path / "killed.log")
    engine = create_engine(f"sqlite:///{srv.state_dir / 'bcm.db'}")
    tables = set(inspect(engine).get_table_names())
    if "alembic_version" in tables:
        with engine.connect() as conn:
            versions = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
        assert versions == [REVISIONS[-1]], versions  # the whole upgrade landed before the kill
    else:
        assert tables == set(), tables  # nothing half-made
    engine.dispose()
    srv.start()
    try:
        assert httpx.get(f"{srv.url}/readyz", timeout=10).status_code == 200
        headers = {"Authorization": f"Bearer {srv.token()}"}
        r = httpx.post(f"{srv.url}/api/v1/nodes", json={"name": "after-crash"}, headers=headers, timeout=30)
        assert r.status_code == 201, r.text
    finally:
        srv.stop()
