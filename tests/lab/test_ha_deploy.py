"""kill -9 of the leading server in the middle of a 4-node Slurm deploy (#27, 6a).

Two real `bcm serve` on one PostgreSQL database, the second added as the README says (the first's
secrets copied before its first start), both serving PXE on loopback; real lab nodes in namespaces
(`bcm lab up`), inventoried. The deploy is sent to the first server, which leads; once its
ansible-playbook is at work on the nodes, that server is killed with SIGKILL. Then: its playbook does
not go on beside the one that takes over (an operation never runs twice at once); the other server
leads and its dnsmasq holds the DHCP port; it takes the deploy up within its lease and runs it to the end on
the same nodes — the cluster deployed and its verification job passed, every node's result ok; no node
stays locked. Lab addresses in namespaces made here (198.18.6.0/24); every wait bounded.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bcm.devserver import Server
from bcm.lab import procs
from bcm.lab.slurm import SlurmLab
from tests.conftest import pg_schema
from tests.faults.test_ha_servers import PXE_ON_LO, live_dnsmasq
from tests.faults.test_ha_servers import wait_for as shared_wait_for

pytestmark = pytest.mark.lab
OPS_LEASE_S = 6.0  # operations; the leader's lease below
ENV = {"BCM_OPS__LEASE_S": str(OPS_LEASE_S), "BCM_HA__LEASE_S": "3", "BCM_LOG_LEVEL": "info", **PXE_ON_LO}
SHARED = ("secret.key", "ssh/id_ed25519", "ssh/id_ed25519.pub", "admin.token", "wlm")  # the README's list
WAIT_S = 120.0


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    return shared_wait_for(what, check, timeout_s)


def playbooks_of(server: Server) -> list[int]:
    """Live ansible-playbook processes working for ``server`` (their files are in its state directory)."""
    mark = str(server.state_dir).encode()
    found = []
    for pid in procs.all_pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            cwd = os.readlink(f"/proc/{pid}/cwd").encode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"ansible-playbook" in argv and (mark in argv or mark in cwd) and state not in ("Z", "X"):
            found.append(pid)
    return found


def add_head(first: Server, state_dir: Path, database_url: str) -> Server:
    """A second server as the README adds one: the first's secrets copied, the same database."""
    for name in SHARED:
        source = first.state_dir / name
        if source.is_dir():
            shutil.copytree(source, state_dir / name)
        elif source.exists():
            (state_dir / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, state_dir / name)
    second = Server(state_dir, database_url=database_url, extra_env=dict(first.extra_env))
    second.start()
    return second


@pytest.fixture
def two_heads(lab_required: None, tmp_path: Path) -> Iterator[tuple[SlurmLab, Server]]:
    if not shutil.which("dnsmasq"):
        pytest.skip("needs dnsmasq")
    with (
        pg_schema() as url,
        SlurmLab.running(
            tmp_path, nodes=4, name="bcmhasl", subnet="198.18.6.0/24", database_url=url, env=ENV
        ) as run,
    ):
        second = add_head(run.server, tmp_path / "second", url)
        try:
            yield run, second
        finally:
            second.stop()


def test_kill_9_of_the_leader_mid_slurm_deploy_the_other_takes_it_up_and_finishes_it(
    two_heads: tuple[SlurmLab, Server],
) -> None:
    run, second = two_heads
    first = run.server
    token = first.token()
    auth = {"Authorization": f"Bearer {token}"}

    def ha(server: Server) -> dict[str, Any]:
        r = httpx.get(f"{server.url}/api/v1/ha", headers=auth, timeout=10)
        assert r.status_code == 200, r.text
        return dict(r.json())

    view = wait_for("the first server leads", lambda: (v := ha(first))["this_server"]["leading"] and v)
    epoch = view["leader"]["epoch"]
    wait_for("the leader's dnsmasq runs", lambda: live_dnsmasq(first) and not live_dnsmasq(second))

    r = run.http.post("/api/v1/wlm/slurm/deploy", json=run.deploy_body())
    assert r.status_code in (200, 202), r.text
    op_id = r.json()["operation_id"]
    op = run.http.get(f"/api/v1/operations/{op_id}").json()
    assert op["owner"] == view["this_server"]["id"] and op["claims"] == 1, op
    # its playbook at work on the nodes for a while (bounded), then the server goes
    playbook = wait_for("the first server's ansible-playbook", lambda: playbooks_of(first), timeout_s=300)
    time.sleep(10)
    assert playbooks_of(first), "the playbook ended before the kill: the test would show nothing"
    assert first.proc is not None
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait(10)

    # the dead server's playbook does not go on beside the one the other server will run
    left = (
        wait_for("the dead server's playbook gone", lambda: not playbooks_of(first) or None, timeout_s=30)
        if playbooks_of(first)
        else True
    )
    assert left and procs.wait_gone(playbook, 5) == []

    # the other server leads with a higher epoch, and its dnsmasq answers
    after = wait_for("the second server leads", lambda: (v := ha(second))["this_server"]["leading"] and v)
    assert after["leader"]["epoch"] > epoch
    wait_for("dnsmasq on the second server", lambda: live_dnsmasq(second) and not live_dnsmasq(first))

    # ... and has the DHCP port open (proxy DHCP on loopback; its TFTP root is not served on lo)
    def dhcp_socket() -> bool:
        out = subprocess.run(
            ["ss", "-Hulpn", "sport = :67"], capture_output=True, text=True, timeout=30
        ).stdout
        return any(f"pid={pid}," in out for pid in live_dnsmasq(second))

    wait_for("the new leader's dnsmasq holds the DHCP port", dhcp_socket)

    # the deploy is taken up there and ends: deployed and verified on every node
    with httpx.Client(base_url=second.url, headers=auth, timeout=60) as http:
        deadline = time.monotonic() + 900
        while (done := http.get(f"/api/v1/operations/{op_id}").json())["state"] in ("pending", "running"):
            assert time.monotonic() < deadline, f"operation {op_id} still {done['state']} after 900 s"
            time.sleep(1)
        explain = (
            f"{done['state']}: {done.get('error')}\n{done.get('results')}\n{done.get('log', '')[-4000:]}"
        )
        assert done["claims"] >= 2 and "taken up by" in done["log"], explain
        assert done["owner"] is None and done["lease_expires"] is None, explain
        assert done["state"] == "succeeded", explain
        results = done["results"]
        assert set(results) == {run.controller, *run.compute}, explain
        assert all(r["status"] == "ok" for r in results.values()), explain
        assert "verify: passed" in done["log"], explain
        cluster = http.get("/api/v1/wlm/lab").json()
        assert cluster["state"] == "deployed" and cluster["last_verify_ok"] is True, cluster
        nodes = http.get("/api/v1/nodes", params={"limit": 100}).json()["items"]
        assert [n["name"] for n in nodes if n["locked_by"]] == []
        assert {n["name"]: n["provision_state"] for n in nodes if n["name"] in run.compute} == {
            n: "ready" for n in run.compute
        }
