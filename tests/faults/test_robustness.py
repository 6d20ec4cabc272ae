"""One `bcm serve` under faults (#27): SQLite under mixed load, hung BMCs, a failing loop, kill -9, SIGTERM.

Each test runs a real server process on loopback and asserts behaviour, never a latency: no 5xx, an
answer at all while something holds the threads, processes gone. Figures are in ``bench/concurrency.py``.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from bcm.devserver import Server
from tests.api.test_health_api import REPORT_URL, report
from tests.faults.conftest import client, hammer, make_nodes

BMC_PASSWORD = "Pw-for-bmc-77"
OPEN = ("pending", "running")  # a power operation is running from its first BMC answer on


def started(tmp_path: Path, name: str = "state", **env: str) -> Server:
    srv = Server(tmp_path / name, extra_env=env)
    srv.start()
    return srv


@pytest.fixture
def silent_bmc() -> Iterator[socket.socket]:
    """A TCP listener on loopback that takes connections and never answers (a hung BMC)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1024)
        yield listener


def hung_bmc_nodes(srv: Server, listener: socket.socket, hostlist: str) -> None:
    port = listener.getsockname()[1]
    with client(srv) as c:
        r = c.post(
            "/api/v1/categories", json={"name": "hung", "bmc_protocol": "redfish", "bmc_user": "admin"}
        )
        assert r.status_code in (201, 409), r.text
        assert c.put("/api/v1/categories/hung/bmc-allow-http", json={"allow": True}).status_code == 200
        r = c.post("/api/v1/nodes/bulk", json={"nodes": hostlist, "category": "hung"})
        assert r.status_code == 201, r.text
        for node in r.json():  # each node its own address field, as a real BMC has
            got = c.patch(f"/api/v1/nodes/{node['name']}", json={"bmc_address": f"http://127.0.0.1:{port}"})
            assert got.status_code == 200, got.text
        r2 = c.put("/api/v1/nodes/bmc-password", json={"nodes": hostlist, "password": BMC_PASSWORD})
        assert r2.status_code == 200, r2.text


def op_state(srv: Server, op_id: int) -> str:
    with client(srv) as c:
        return str(c.get(f"/api/v1/operations/{op_id}").json()["state"])


def wait_for(what: str, check: Callable[[], bool], tries: int = 300, every: float = 0.1) -> None:
    for _ in range(tries):  # bounded
        if check():
            return
        time.sleep(every)
    raise AssertionError(f"never happened: {what}")


# ---- SQLite under mixed load ------------------------------------------------------------------------


def bind(
    kind: Callable[[httpx.Client, str], httpx.Response], node: str
) -> Callable[[httpx.Client], httpx.Response]:
    return lambda c: kind(c, node)


@pytest.mark.parametrize("clients", [50, 200])
def test_mixed_clients_on_sqlite_get_no_5xx(tmp_path: Path, clients: int) -> None:
    """PATCH, verbs, reads and health reports at once: the write turn is never held across a wait for a
    worker thread, so no writer times out into a 503."""
    srv = started(tmp_path)
    try:
        make_nodes(srv, "mx[1-5]", state="ready")
        with client(srv) as c:
            tokens = {f"mx{i}": c.post(f"/api/v1/nodes/mx{i}/token").json()["token"] for i in range(1, 6)}
        reports = {n: report(n) for n in tokens}
        rng = random.Random(27)
        patch: Callable[[httpx.Client, str], httpx.Response] = lambda c, n: c.patch(  # noqa: E731
            f"/api/v1/nodes/{n}", json={"comment": f"c{rng.random():.6f}"}
        )
        kinds: list[Callable[[httpx.Client, str], httpx.Response]] = [
            *[patch] * 12,  # writes of plain handlers, the most of all (#27: "mixing PATCH and verbs")
            lambda c, n: c.post("/api/v1/nodes/actions/drain", json={"nodes": n}),
            lambda c, n: c.post("/api/v1/nodes/actions/resume", json={"nodes": n}),
            lambda c, n: c.get("/api/v1/nodes", params={"limit": 50}),
            lambda c, n: c.get(f"/api/v1/nodes/{n}"),
            lambda c, n: c.post(
                REPORT_URL, json=reports[n], headers={"Authorization": f"Bearer {tokens[n]}"}
            ),
            lambda c, n: c.get("/healthz"),
            lambda c, n: c.get("/readyz"),
        ]
        requests: list[Callable[[httpx.Client], httpx.Response]] = []
        for i in range(max(clients * 2, 400)):  # bounded: a fixed list, `clients` at a time
            kind, node = kinds[i % len(kinds)], f"mx{rng.randint(1, 5)}"
            requests.append(bind(kind, node))
        answers = hammer(srv, clients, requests)
        assert not answers.server_errors(), answers.server_errors()[:5]
        assert set(answers.statuses) <= {200, 202, 409}, sorted(set(answers.statuses))
        assert answers.statuses.count(202) >= 1  # health reports were stored among the writers
    finally:
        srv.stop()


# ---- hung BMCs ----------------------------------------------------------------------------------------


def test_healthz_and_reads_answer_while_two_power_operations_hang(
    tmp_path: Path, silent_bmc: socket.socket
) -> None:
    """Two power operations of 40 nodes against BMCs that never answer hold 64 BMC calls at once (more
    than the 40 request threads): /healthz and a plain read still answer while every call still hangs."""
    srv = started(tmp_path, BCM_POWER__TIMEOUT_S="300", BCM_POWER__RETRIES="0")
    try:
        hung_bmc_nodes(srv, silent_bmc, "ha[01-40],hb[01-40]")
        with client(srv) as c:
            ops = [
                c.post("/api/v1/nodes/actions/power-on", json={"nodes": nodes}).json()["operation_id"]
                for nodes in ("ha[01-40]", "hb[01-40]")
            ]
        wait_for("both operations open", lambda: all(op_state(srv, op) in OPEN for op in ops))
        with httpx.Client(base_url=srv.url, timeout=60) as plain:
            assert plain.get("/healthz").status_code == 200
            assert plain.get("/readyz").status_code == 200
        with client(srv) as c:
            assert c.get("/api/v1/nodes/ha01").status_code == 200  # a plain handler: a request thread
        # ... and the BMC calls were still hanging then: nothing answered them yet
        assert all(op_state(srv, op) in OPEN for op in ops)
    finally:
        silent_bmc.close()
        srv.stop()


# ---- a failing loop, and shutdown -----------------------------------------------------------------------


def test_a_failing_loop_is_retried_and_shutdown_still_stops_everything(
    tmp_path: Path, silent_bmc: socket.socket
) -> None:
    """The workload-manager sync fails on every pass (its table is gone): it is logged once and retried,
    and SIGTERM still stops every part, the runner last: the hung power operation is closed, its locks
    released."""
    first = started(tmp_path)
    hung_bmc_nodes(first, silent_bmc, "sd[1-4]")
    first.stop()
    db = first.state_dir / "bcm.db"
    with sqlite3.connect(db) as conn:
        conn.execute("ALTER TABLE wlm_cluster RENAME TO wlm_cluster_away")
    srv = Server(
        first.state_dir,
        extra_env={
            "BCM_WLM__SYNC_INTERVAL_S": "0.1",
            "BCM_LOG_LEVEL": "debug",
            "BCM_POWER__TIMEOUT_S": "300",
            "BCM_POWER__RETRIES": "0",
        },
    )
    srv.start()
    assert srv.proc is not None and srv.log is not None
    log = srv.log
    try:
        wait_for("the sync's failure logged", lambda: "workload-manager sync failed (" in log.read_text())
        wait_for("the sync retried", lambda: "workload-manager sync failed again" in log.read_text())
        text = log.read_text()
        assert text.count("workload-manager sync failed (") == 1  # once for the whole streak
        with client(srv) as c:
            op = c.post("/api/v1/nodes/actions/power-on", json={"nodes": "sd[1-4]"}).json()["operation_id"]
        wait_for("the operation open", lambda: op_state(srv, op) in OPEN)
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(120)  # bounded: the test fails here if shutdown hangs
    finally:
        srv.stop()
    with sqlite3.connect(db) as conn:
        state = conn.execute("SELECT state FROM operation WHERE id = ?", (op,)).fetchone()[0]
        locks = conn.execute("SELECT name, lock_owner FROM node WHERE lock_owner IS NOT NULL").fetchall()
    assert state not in ("pending", "running"), state
    assert locks == []


# ---- processes ------------------------------------------------------------------------------------------


def children(pid: int) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_kill_9_of_the_server_leaves_no_writer_process(tmp_path: Path) -> None:
    srv = started(tmp_path, BCM_HEALTH__INGEST_PROCESSES="2")
    assert srv.proc is not None
    try:
        make_nodes(srv, "kw1")
        with client(srv) as c:
            token = c.post("/api/v1/nodes/kw1/token").json()["token"]
            r = c.post(REPORT_URL, json=report("kw1"), headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 202, r.text  # written by a writer process
        writers = children(srv.proc.pid)
        assert writers, "no writer process started"
        srv.proc.kill()
        srv.proc.wait(30)
        wait_for("the writer processes gone", lambda: not any(alive(p) for p in writers), tries=200)
    finally:
        srv.stop()
        for pid in [
            p for p in locals().get("writers", ()) if alive(p)
        ]:  # left by a failure: not for later tests
            os.kill(pid, signal.SIGKILL)


def test_sigterm_with_a_stuck_request_ends_within_its_bound(tmp_path: Path) -> None:
    """A request whose body never comes (its own timeout an hour) does not hold SIGTERM: the server
    stops after ``http.graceful_shutdown_s``."""
    srv = started(tmp_path, BCM_HTTP__BODY_TIMEOUT_S="3600", BCM_HTTP__GRACEFUL_SHUTDOWN_S="1")
    assert srv.proc is not None
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=60) as stuck:
            stuck.sendall(
                b"POST /api/v1/nodes HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {srv.token()}\r\n".encode()
                + b'Content-Length: 1000\r\n\r\n{"name": '
            )
            with client(srv) as c:  # the server has taken the stuck request and goes on answering
                assert c.get("/api/v1/nodes").status_code == 200
            srv.proc.send_signal(signal.SIGTERM)
            try:
                srv.proc.wait(120)  # bounded: without a graceful bound it waits for the body an hour
            except subprocess.TimeoutExpired:
                pytest.fail("bcm serve still waits for the stuck request after SIGTERM")
    finally:
        srv.stop()
