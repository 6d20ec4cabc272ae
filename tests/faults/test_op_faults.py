"""Operations through faults, with a real `bcm serve`: a PostgreSQL outage in the middle of an inventory,
and a cancel during a power operation whose BMCs hang. Each ends in a final state, nothing locked."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from bcm.devserver import Server
from tests.faults.conftest import client
from tests.faults.test_operations import ADDRESSES, _wait, silent_ssh, start_inventory  # noqa: F401
from tests.faults.test_pg_outage import Cluster, cluster  # noqa: F401  (a fixture)
from tests.faults.test_robustness import hung_bmc_nodes, silent_bmc, started  # noqa: F401

OPEN = ("pending", "running")


def _ended(srv: Server, op_id: int) -> dict[str, Any]:
    with client(srv) as c:
        return dict(
            _wait(
                "the operation to end",
                lambda: (o := c.get(f"/api/v1/operations/{op_id}").json())["state"] not in OPEN and o,
                timeout=90,
            )
        )


def _locked(srv: Server, hostlist: str) -> list[tuple[str, str | None]]:
    with client(srv) as c:
        nodes = c.get("/api/v1/nodes", params={"nodes": hostlist}).json()["items"]
    return [(n["name"], n["locked_by"]) for n in nodes if n["locked_by"]]


def test_an_inventory_through_a_postgresql_outage_ends_with_nothing_locked(
    tmp_path: Path,
    cluster: Cluster,  # noqa: F811
    silent_ssh: int,  # noqa: F811
) -> None:
    """PostgreSQL stops while an inventory runs and stays away past the job's end and its lease: the
    job's result writes fail, its lease lapses; once the database is back the operation is taken up
    again (a second claim) and ends, every node unlocked, without a restart of bcm."""
    srv = Server(
        tmp_path / "state",
        database_url=cluster.url,
        extra_env={
            "BCM_SSH__PORT": str(silent_ssh),
            "BCM_SSH__CONNECT_TIMEOUT_S": "3",
            "BCM_OPS__LEASE_S": "3",
        },
    )
    srv.start()
    assert srv.log is not None
    log = srv.log
    try:
        with client(srv) as c:
            r = c.post("/api/v1/nodes/bulk", json={"nodes": "hang[1-3]", "ip": ADDRESSES[0]})
            assert r.status_code == 201, r.text
        op_id = start_inventory(srv)
        cluster.stop()
        # the job met the outage and gave up once its lease lapsed (bounded by the lease, 3 s)
        _wait("the job to give up", lambda: "database away past its lease" in log.read_text(), timeout=60)
        cluster.start()
        op = _ended(srv, op_id)
        assert op["state"] in ("failed", "partial", "succeeded"), op
        assert op["claims"] >= 2 and op["owner"] is None, op
        assert set(op["results"]) == {"hang1", "hang2", "hang3"}, op["results"]
        assert _locked(srv, "hang[1-3]") == []
    finally:
        srv.stop()


def test_a_cancelled_power_operation_ends_cancelled(tmp_path: Path, silent_bmc: socket.socket) -> None:  # noqa: F811
    """`bcm op cancel` while every BMC hangs: the operation is cancelled, not 'interrupted', and stays so
    after the job's last write (refused); its nodes are free at once."""
    srv = started(tmp_path, BCM_POWER__TIMEOUT_S="300", BCM_POWER__RETRIES="0")
    try:
        hung_bmc_nodes(srv, silent_bmc, "pc[1-4]")
        with client(srv) as c:
            op_id = c.post("/api/v1/nodes/actions/power-on", json={"nodes": "pc[1-4]"}).json()["operation_id"]
            _wait("the BMC calls to start", lambda: bool(_locked(srv, "pc[1-4]")))
        done = srv.cli("op", "cancel", str(op_id), "--json")
        assert done.returncode == 0, done.stderr
        with client(srv) as c:
            op = c.get(f"/api/v1/operations/{op_id}").json()
        assert op["state"] == "cancelled" and op["error"].startswith("cancelled by"), op
        assert "interrupted" not in op["log"], op["log"]
        assert _locked(srv, "pc[1-4]") == []
    finally:
        srv.stop()
