"""PostgreSQL stops under load: 503 + Retry-After within the timeout, recovery without a restart of bcm.

The cluster is the test's own (initdb in a temporary directory, its own port), never the shared one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bcm.devserver import Server, free_port
from tests.api.test_health_api import REPORT_URL, report
from tests.faults.conftest import client, hammer

PG_BIN = Path("/usr/lib/postgresql/15/bin")
SLOW_S = 20.0  # a refused or cut connection answers at once; generous for a loaded machine


@dataclass
class Cluster:
    data: Path
    port: int
    log: Path

    def _pg(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [str(PG_BIN / args[0]), *args[1:]]
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)

    def start(self) -> None:
        opts = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.data.parent} -c fsync=off"
        r = self._pg(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "-t", "60", "start"
        )
        assert r.returncode == 0, r.stdout + r.stderr + self.log.read_text()

    def stop(self) -> None:
        r = self._pg("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")
        assert r.returncode == 0, r.stdout + r.stderr

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    if not (PG_BIN / "initdb").exists():
        pytest.skip(f"no PostgreSQL server binaries in {PG_BIN}")
    # its own directory, outside pytest's (root-only) one, that the postgres user can enter
    home = Path(tempfile.mkdtemp(prefix="bcm-faults-pg-"))
    if os.geteuid() == 0:
        shutil.chown(home, "postgres")
    c = Cluster(home / "data", free_port(), home / "postgres.log")
    r = c._pg("initdb", "-D", str(c.data), "-U", "postgres", "--auth=trust", "--no-sync")
    assert r.returncode == 0, r.stdout + r.stderr
    c.start()
    try:
        yield c
    finally:
        c._pg("pg_ctl", "-D", str(c.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(home, ignore_errors=True)


def test_postgresql_stopped_under_load(tmp_path: Path, cluster: Cluster) -> None:
    srv = Server(tmp_path / "state", database_url=cluster.url)
    srv.start()
    try:
        acknowledged = []
        with client(srv) as c:
            for i in range(10):
                r = c.post("/api/v1/nodes", json={"name": f"before{i}"})
                assert r.status_code == 201, r.text
                acknowledged.append(f"before{i}")
        cluster.stop()
        during = hammer(
            srv,
            10,
            [lambda c, i=i: c.post("/api/v1/nodes", json={"name": f"during{i}"}) for i in range(15)]
            + [lambda c: c.get("/api/v1/nodes") for _ in range(15)]
            + [lambda c: c.get("/readyz") for _ in range(5)],
        )
        assert set(during.statuses) == {503}, during.got[:5]
        assert during.slowest < SLOW_S, during.slowest
        assert all('"error":"Unavailable"' in body for _, _, body in during.got), during.got[:3]
        with client(srv) as c:
            r = c.get("/readyz")
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
            r = c.post("/api/v1/nodes", json={"name": "refused"})
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, r.text
            assert c.get("/healthz").status_code == 200  # alive, only not ready
        cluster.start()
        with client(srv) as c:
            for _ in range(60):  # bounded: the pool notices the new server on its next checkout
                if c.get("/readyz").status_code == 200:
                    break
            assert c.get("/readyz").status_code == 200
            r = c.post("/api/v1/nodes", json={"name": "after"})
            assert r.status_code == 201, r.text
            acknowledged.append("after")
            names = {n["name"] for n in c.get("/api/v1/nodes", params={"limit": 1000}).json()["items"]}
        assert set(acknowledged) <= names  # no acknowledged write lost
        assert not {n for n in names if n.startswith("during")}  # and no refused one half-done
    finally:
        srv.stop()


def test_health_writer_processes_outlive_a_postgresql_restart(tmp_path: Path, cluster: Cluster) -> None:
    """Writer processes (health.ingest_processes) keep their connections between batches; across a restart
    of PostgreSQL a report is refused with 503 + Retry-After, never acknowledged unstored, and after it
    the agent's next tries are stored."""
    srv = Server(
        tmp_path / "state", database_url=cluster.url, extra_env={"BCM_HEALTH__INGEST_PROCESSES": "2"}
    )
    srv.start()
    try:
        with client(srv) as c:
            assert c.post("/api/v1/nodes", json={"name": "gpu01"}).status_code == 201
            token = c.post("/api/v1/nodes/gpu01/token").json()["token"]
            body = report("gpu01")

            def send() -> httpx.Response:
                return c.post(REPORT_URL, json=body, headers={"Authorization": f"Bearer {token}"})

            def last_report() -> str:
                return str(c.get("/api/v1/health/nodes").json()["items"][0]["last_report_at"])

            assert send().status_code == 202
            before = last_report()
            cluster.stop()
            r = send()
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, r.text
            cluster.start()
            answers = []
            for _ in range(5):  # bounded: a connection the restart cut costs at most its batch
                answers.append(send().status_code)
                if answers[-1] == 202:
                    break
            assert answers[-1] == 202 and set(answers) <= {202, 503}, answers
            assert last_report() > before  # the acknowledged report is stored
    finally:
        srv.stop()
