"""A PostgreSQL standby promoted under a running `bcm serve` with a multi-host URL (#27 item 4, 6d).

Two clusters of this machine's PostgreSQL 15 on free loopback ports: a primary and a `pg_basebackup -R`
streaming standby, synchronous (`synchronous_standby_names='*'`). `bcm serve` gets
``postgresql+psycopg://bcm@/bcm?host=127.0.0.1:P1&host=127.0.0.1:P2&target_session_attrs=read-write``;
20 agents post health reports with their node tokens, each report carrying a sequence number (GPU 0's
power draw). The primary is stopped (``-m immediate``) and the standby promoted. Then: every answer was
202 or 503 (with Retry-After), never another error or a dropped connection; the same server process
answers 202 again from the new primary without a restart; every acknowledged report is in the new
primary's database. Needs root (`pg_createcluster`, `runuser`); the clusters are dropped afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from bcm.devserver import Server, free_port
from bcm.models.health import RECORD_FIELDS

pytestmark = [pytest.mark.lab, pytest.mark.pg]

AGENTS = 20
MAX_POSTS = 400  # per agent: the loops are bounded in count ...
WALL_S = 90.0  # ... and in time
PAUSE_S = 0.05  # between one agent's reports
VERSION = "15"
HBA = """local all all trust
host all all 127.0.0.1/32 trust
local replication all trust
host replication all 127.0.0.1/32 trust
"""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=120, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: rc {proc.returncode}: {proc.stderr[-2000:]}")
    return proc


def _ctl(name: str, *action: str) -> None:
    _run("pg_ctlcluster", "--skip-systemctl-redirect", VERSION, name, *action)


def _psql(port: int, sql: str) -> str:
    return _run(
        "runuser",
        "-u",
        "postgres",
        "--",
        "psql",
        "-h",
        "/var/run/postgresql",
        "-p",
        str(port),
        "-d",
        "postgres",
        "-Atc",
        sql,
    ).stdout.strip()


@dataclass
class Pair:
    primary: str
    standby: str
    p1: int
    p2: int

    @property
    def url(self) -> str:
        return (
            f"postgresql+psycopg://bcm@/bcm?host=127.0.0.1:{self.p1}&host=127.0.0.1:{self.p2}"
            "&target_session_attrs=read-write"
        )


@pytest.fixture
def pg_pair() -> Iterator[Pair]:
    if os.geteuid() != 0 or not shutil.which("pg_createcluster") or not shutil.which("runuser"):
        pytest.skip("needs root and Debian's postgresql-common (pg_createcluster)")
    tag = uuid.uuid4().hex[:6]
    pair = Pair(f"bcmha{tag}p", f"bcmha{tag}s", free_port(), free_port())
    made: list[str] = []
    try:
        for name, port in ((pair.primary, pair.p1), (pair.standby, pair.p2)):
            _run("pg_createcluster", VERSION, name, "-p", str(port), "--start-conf", "manual")
            made.append(name)
            Path(f"/etc/postgresql/{VERSION}/{name}/pg_hba.conf").write_text(HBA)
        _ctl(pair.primary, "start")
        _psql(pair.p1, "CREATE ROLE bcm LOGIN SUPERUSER")
        _psql(pair.p1, "CREATE DATABASE bcm OWNER bcm")
        data = Path(f"/var/lib/postgresql/{VERSION}/{pair.standby}")
        shutil.rmtree(data)
        _run(
            "runuser",
            "-u",
            "postgres",
            "--",
            "pg_basebackup",
            "-h",
            "/var/run/postgresql",
            "-p",
            str(pair.p1),
            "-D",
            str(data),
            "-R",
            "-X",
            "stream",
            "-C",
            "-S",
            pair.standby,
            "-c",
            "fast",
        )
        _ctl(pair.standby, "start")
        # synchronous from here on (set after cloning: the standby must not inherit it)
        _psql(pair.p1, "ALTER SYSTEM SET synchronous_standby_names = '*'")
        _psql(pair.p1, "SELECT pg_reload_conf()")
        deadline = time.monotonic() + 30
        while _psql(pair.p1, "SELECT sync_state FROM pg_stat_replication") != "sync":
            assert time.monotonic() < deadline, "the standby never became synchronous"
            time.sleep(0.2)
        yield pair
    finally:
        for name in reversed(made):
            _run("pg_dropcluster", "--stop", VERSION, name, check=False)


@dataclass
class Agent:
    name: str
    token: str
    answers: list[tuple[int, int, bool]] = field(default_factory=list)  # (seq, status, after the switch)
    errors: list[str] = field(default_factory=list)  # anything but 202 and 503-with-Retry-After

    def acked(self, after: bool | None = None) -> list[int]:
        return [seq for seq, st, a in self.answers if st == 202 and (after is None or a == after)]


def _report(name: str, seq: int) -> dict[str, object]:
    return {
        "schema": 1,
        "agent_version": "ha-test",
        "hostname": name,
        "collected_at": datetime.now(UTC).isoformat(),
        "gpu_count": 1,
        "gpus": [
            {
                "index": 0,
                "uuid": f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, name)}",
                "temperature_c": 40,
                "power_draw_w": float(seq),
                "power_limit_w": 700.0,
            }
        ],
    }


def test_standby_promotion_under_agents_loses_no_acknowledged_report(tmp_path: Path, pg_pair: Pair) -> None:
    srv = Server(
        tmp_path / "state",
        database_url=pg_pair.url,
        extra_env={"BCM_DB__CONNECT_TIMEOUT_S": "2", "BCM_HEALTH__INTERVAL_S": "3600"},
    )
    try:
        srv.start()  # inside: a start that timed out leaves a process to stop too
        admin = {"Authorization": f"Bearer {srv.token()}"}
        r = httpx.post(
            f"{srv.url}/api/v1/nodes/bulk",
            json={"nodes": f"agent[01-{AGENTS:02d}]"},
            headers=admin,
            timeout=30,
        )
        assert r.status_code == 201, r.text
        agents = []
        for node in r.json():
            issued = httpx.post(f"{srv.url}/api/v1/nodes/{node['name']}/token", headers=admin, timeout=30)
            assert issued.status_code == 201, issued.text
            agents.append(Agent(node["name"], issued.json()["token"]))

        switched = threading.Event()
        stop = threading.Event()
        started = time.monotonic()

        def run(agent: Agent) -> None:
            with httpx.Client(
                base_url=srv.url, timeout=30, headers={"Authorization": f"Bearer {agent.token}"}
            ) as c:
                for seq in range(1, MAX_POSTS + 1):
                    if stop.is_set() or time.monotonic() - started > WALL_S:
                        return
                    after = switched.is_set()
                    try:
                        resp = c.post("/boot/v1/agent/report", json=_report(agent.name, seq))
                    except httpx.HTTPError as exc:
                        agent.errors.append(f"{seq}: {type(exc).__name__}: {exc}")
                        continue
                    agent.answers.append((seq, resp.status_code, after))
                    if resp.status_code == 503 and not resp.headers.get("Retry-After"):
                        agent.errors.append(f"{seq}: 503 without Retry-After")
                    elif resp.status_code not in (202, 503):
                        agent.errors.append(f"{seq}: {resp.status_code} {resp.text[:200]}")
                    time.sleep(PAUSE_S)

        threads = [threading.Thread(target=run, args=(a,), daemon=True) for a in agents]
        for t in threads:
            t.start()

        def wait(what: str, cond: object) -> None:
            deadline = time.monotonic() + 60
            while not cond():  # type: ignore[operator]
                assert time.monotonic() < deadline, f"{what} within 60 s"
                assert all(t.is_alive() for t in threads) or stop.is_set(), "an agent ended early"
                time.sleep(0.1)

        wait("every agent acknowledged before the switch", lambda: all(len(a.acked()) >= 3 for a in agents))
        pid = srv.proc.pid if srv.proc else None
        _ctl(pg_pair.primary, "stop", "-m", "immediate")
        switched.set()
        _ctl(pg_pair.standby, "promote")
        _psql(pg_pair.p2, "ALTER SYSTEM RESET synchronous_standby_names")  # nothing to wait for any more
        _psql(pg_pair.p2, "SELECT pg_reload_conf()")
        wait(
            "every agent acknowledged by the new primary",
            lambda: all(len(a.acked(True)) >= 3 for a in agents),
        )
        stop.set()
        for t in threads:
            t.join(60)

        assert srv.proc is not None and srv.proc.poll() is None and srv.proc.pid == pid  # never restarted
        errors = [f"{a.name} {e}" for a in agents for e in a.errors]
        assert errors == [], errors[:20]
        statuses = {st for a in agents for _, st, _ in a.answers}
        assert statuses <= {202, 503}, statuses

        engine = create_engine(f"postgresql+psycopg://bcm@127.0.0.1:{pg_pair.p2}/bcm")
        try:
            with engine.connect() as conn:
                rows = conn.execute(
                    text("SELECT n.name, r.gpus FROM healthrecord r JOIN node n ON n.id = r.node_id")
                ).all()
        finally:
            engine.dispose()
        stored: dict[str, set[int]] = {}
        power = RECORD_FIELDS.index("power_draw_w")
        for name, gpus in rows:
            stored.setdefault(name, set()).add(int(gpus[0][power]))
        lost = {a.name: sorted(set(a.acked()) - stored.get(a.name, set())) for a in agents}
        assert {k: v for k, v in lost.items() if v} == {}, "acknowledged reports missing after the promotion"
        assert sum(len(a.acked()) for a in agents) >= 6 * AGENTS
        unavailable = sum(1 for a in agents for _, st, _ in a.answers if st == 503)
        print(
            f"{sum(len(a.acked()) for a in agents)} reports acknowledged, {unavailable} answered 503 "
            f"during the switch, {len(rows)} stored"
        )
    finally:
        srv.stop()
