"""Operations outlive their server: kill -9 and SIGTERM during an inventory, and `bcm op cancel`.

The nodes' addresses are loopback listeners that accept SSH connections and never answer, so the
inventory is in flight for as long as the test wants it to be. An operation is held under a lease:
the restarted server takes up what the dead one left (an inventory is resumable) and ends it.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from bcm.devserver import Server, free_port
from tests.faults.conftest import client

ADDRESSES = ["127.0.0.5", "127.0.0.6", "127.0.0.7"]


@pytest.fixture
def silent_ssh() -> Iterator[int]:
    """A port on 127.0.0.5-7 where connections are accepted and never answered."""
    port = free_port()
    stop = threading.Event()
    held: list[socket.socket] = []
    listeners = []
    for addr in ADDRESSES:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
        s.listen(64)
        s.settimeout(0.2)
        listeners.append(s)

    def accept() -> None:
        deadline = time.monotonic() + 600  # bounded even if a test forgets to stop it
        while not stop.is_set() and time.monotonic() < deadline:
            for s in listeners:
                with contextlib.suppress(TimeoutError, OSError):
                    held.append(s.accept()[0])

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield port
    stop.set()
    t.join(5)
    for s in held + listeners:
        s.close()


@pytest.fixture
def server(tmp_path: Path, silent_ssh: int) -> Iterator[Server]:
    srv = Server(
        tmp_path / "state",
        extra_env={"BCM_SSH__PORT": str(silent_ssh), "BCM_SSH__CONNECT_TIMEOUT_S": "300"},
    )
    srv.start()
    with client(srv) as c:
        r = c.post("/api/v1/nodes/bulk", json={"nodes": "hang[1-3]", "ip": ADDRESSES[0]})
        assert r.status_code == 201, r.text
    try:
        yield srv
    finally:
        srv.stop()


def _wait(what: str, check: Any, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def start_inventory(srv: Server) -> int:
    with client(srv) as c:
        r = c.post("/api/v1/nodes/actions/inventory", json={"nodes": "hang[1-3]"})
        assert r.status_code == 200, r.text
        op_id = int(r.json()["operation_id"])
        _wait(
            "the inventory to run", lambda: c.get(f"/api/v1/operations/{op_id}").json()["state"] == "running"
        )
        nodes = c.get("/api/v1/nodes", params={"nodes": "hang[1-3]"}).json()["items"]
        assert all(n["locked_by"] for n in nodes), nodes
        return op_id


def assert_closed_and_unlocked(srv: Server, op_id: int, state: str) -> None:
    with client(srv) as c:
        op = c.get(f"/api/v1/operations/{op_id}").json()
        assert op["state"] == state, op
        assert op["finished_at"] and op["error"], op
        nodes = c.get("/api/v1/nodes", params={"nodes": "hang[1-3]"}).json()["items"]
        assert [(n["locked_by"], n["target_state"]) for n in nodes] == [(None, None)] * 3, nodes


def assert_a_retry_runs(srv: Server) -> None:
    """The same nodes take a new inventory at once; it ends by itself (the hosts still never answer)."""
    with client(srv) as c:
        r = c.post("/api/v1/nodes/actions/inventory", json={"nodes": "hang[1-3]"})
        assert r.status_code == 200, r.text
        op_id = r.json()["operation_id"]
        op = _wait(
            "the retry to end",
            lambda: (
                (o := c.get(f"/api/v1/operations/{op_id}").json())["state"] not in ("pending", "running")
                and o
            ),
        )
    assert op["state"] == "failed" and op["progress_done"] == 3, op
    assert {r["status"] for r in op["results"].values()} == {"timed_out"}, op["results"]


def assert_taken_up_and_ended(srv: Server, op_id: int) -> None:
    """The restarted server took the operation up (a second claim), ran it to its end, unlocked."""
    with client(srv) as c:
        op = _wait(
            "the taken-up operation to end",
            lambda: (
                (o := c.get(f"/api/v1/operations/{op_id}").json())["state"] not in ("pending", "running")
                and o
            ),
        )
        nodes = c.get("/api/v1/nodes", params={"nodes": "hang[1-3]"}).json()["items"]
    assert op["claims"] == 2 and "taken up by" in c_log(srv, op_id), op
    assert op["state"] == "failed" and op["owner"] is None, op
    assert {r["status"] for r in op["results"].values()} == {"timed_out"} and op["progress_done"] == 3, op
    assert [(n["locked_by"], n["target_state"]) for n in nodes] == [(None, None)] * 3, nodes


def c_log(srv: Server, op_id: int) -> str:
    with client(srv) as c:
        return str(c.get(f"/api/v1/operations/{op_id}").json()["log"])


def restart_quick(srv: Server) -> None:
    srv.extra_env["BCM_SSH__CONNECT_TIMEOUT_S"] = "2"  # the retry gives up on silent hosts quickly
    srv.start()


def test_kill_9_during_an_inventory(server: Server) -> None:
    op_id = start_inventory(server)
    assert server.proc is not None
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)
    restart_quick(server)
    assert_taken_up_and_ended(server, op_id)
    assert_a_retry_runs(server)


def test_sigterm_during_an_inventory_ends_it_before_exit(server: Server) -> None:
    """SQLite has one server: no other can take the operation up, so SIGTERM ends it, unfinished nodes
    failed with the reason, locks released (on PostgreSQL it is handed back: test_pg_outage)."""
    op_id = start_inventory(server)
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once shut down
    # the stopping server ended it itself: look in the database before any restart
    engine = create_engine(f"sqlite:///{server.state_dir / 'bcm.db'}")
    with engine.connect() as conn:
        op = conn.execute(
            text("SELECT state, owner, error, results FROM operation WHERE id = :i"), {"i": op_id}
        ).one()
        locks = conn.execute(text("SELECT count(*) FROM node WHERE lock_owner IS NOT NULL")).scalar()
    engine.dispose()
    assert op.state == "failed" and op.owner is None and locks == 0, op
    assert op.error == "interrupted: the server stopped while it ran"
    assert {r["status"] for r in json.loads(op.results).values()} == {"interrupted"}
    restart_quick(server)
    assert_closed_and_unlocked(server, op_id, "failed")
    assert_a_retry_runs(server)


def test_cancel_stops_an_inventory_and_releases_its_nodes(server: Server) -> None:
    op_id = start_inventory(server)
    done = server.cli("op", "cancel", str(op_id), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["state"] == "cancelled"
    assert_closed_and_unlocked(server, op_id, "cancelled")
    with client(server) as c:
        again = c.post(f"/api/v1/operations/{op_id}/cancel")
        assert again.status_code == 409 and "cancelled" in again.json()["message"]
        assert c.post("/api/v1/operations/999999/cancel").status_code == 404
    # the server keeps serving; a new inventory of the same nodes starts at once
    second = start_inventory(server)
    assert second != op_id
