"""SSH inventory of real lab nodes through the real server and CLI, with broken nodes in the batch."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from bcm.devserver import Server

pytestmark = pytest.mark.lab


def api(srv: Server) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {srv.token()}"}, timeout=60)


def real_facts(built: Any, name: str) -> dict[str, Any]:
    """What the node really has, read inside it without bcm."""
    mem_kib = int(
        next(
            line.split()[1]
            for line in built.run(name, ["cat", "/proc/meminfo"]).stdout.splitlines()
            if line.startswith("MemTotal:")
        )
    )
    links = json.loads(built.run(name, ["ip", "-j", "link", "show", "eth0"]).stdout)
    addrs = json.loads(built.run(name, ["ip", "-j", "addr", "show", "eth0"]).stdout)
    return {
        "hostname": built.run(name, ["hostname"]).stdout.strip(),
        "mac": links[0]["address"],
        "ips": {a["local"] for a in addrs[0]["addr_info"] if a["family"] == "inet"},
        "memory_bytes": mem_kib * 1024,
    }


def test_inventory_with_broken_nodes(lab: Any, tmp_path: Path) -> None:
    srv = Server(
        tmp_path / "state", extra_env={"BCM_SSH__CONNECT_TIMEOUT_S": "4", "BCM_SSH__COMMAND_TIMEOUT_S": "30"}
    )
    srv.start()
    built = None
    try:
        http = api(srv)
        pubkey = http.get("/api/v1/ssh/public-key").json()["public_key"]
        built = lab(12, [pubkey], name="bcminv", subnet="198.18.2.0/24")
        nodes = built.status()
        for n in nodes:
            r = http.post(
                "/api/v1/nodes",
                json={"name": n.name, "mac": n.mac, "ip": n.ip, "ssh_host_key": n.host_key_public},
            )
            assert r.status_code == 201, r.text
        # four broken nodes in one batch with eight healthy ones
        built.kill("node09")  # unreachable: nothing listens
        built.freeze("node10")  # sshd hangs after the TCP connect
        built.run("node11", ["rm", "-f", "/root/.ssh/authorized_keys"])  # our key is refused
        built.rekey("node12")  # a different host key than the one registered

        res = srv.cli("node", "inventory", "node[01-12]", "--json")
        assert res.returncode == 1, (res.stdout, res.stderr)  # not every node succeeded
        assert res.stdout.strip(), res.stderr
        op = json.loads(res.stdout)
        assert op["state"] == "partial" and op["progress_done"] == 12
        status = {name: r["status"] for name, r in op["results"].items()}
        assert status == {
            **{f"node{i:02d}": "ok" for i in range(1, 9)},
            "node09": "unreachable",
            "node10": "timed_out",
            "node11": "auth_failed",
            "node12": "host_key_changed",
        }

        for i in range(1, 9):
            name = f"node{i:02d}"
            hw = http.get(f"/api/v1/nodes/{name}/hardware").json()
            real, facts = real_facts(built, name), hw["facts"]
            assert facts["hostname"] == real["hostname"] == name
            nic = next(n for n in facts["nics"] if n["name"] == "eth0")
            assert nic["mac"] == real["mac"] == next(n.mac for n in nodes if n.name == name)
            assert real["ips"] == {next(n.ip for n in nodes if n.name == name)}
            assert real["ips"] <= {a.split("/")[0] for a in nic["addresses"]}  # facts hold CIDR
            assert facts["memory_bytes"] == real["memory_bytes"]
            assert facts["cpu"]["threads"] >= 1
            node = http.get(f"/api/v1/nodes/{name}").json()
            assert node["provision_state"] == "inventoried" and node["last_error"] is None

        states = {
            n["name"]: (n["provision_state"], n["last_error"] or "")
            for n in http.get("/api/v1/nodes", params={"nodes": "node[09-12]"}).json()["items"]
        }
        assert states["node09"][0] == "unreachable" and states["node10"][0] == "unreachable"
        assert states["node11"][0] == "registered" and "auth_failed" in states["node11"][1]
        assert states["node12"][0] == "registered" and "host key changed" in states["node12"][1]
        changed = http.get("/api/v1/events", params={"action": "node.host_key_changed"}).json()
        assert [e["target"] for e in changed] == ["node12"] and changed[0]["severity"] == "error"
        assert http.get("/api/v1/nodes/node12/hardware").json()["facts"] == {}  # nothing collected from it

        # the table view: per-node results and a progress bar, and `node show` shows the hardware
        shown = srv.cli("node", "show", "node01")
        assert shown.returncode == 0 and "GiB" in shown.stdout
        # once repaired, the node inventories fine and the lock of the first operation is gone
        built.thaw("node10")
        again = srv.cli("node", "inventory", "node10")
        assert again.returncode == 0, again.stdout + again.stderr
        assert "node10" in again.stdout and "ok" in again.stdout
    finally:
        if built is not None:
            if built.node("node10").frozen:
                built.thaw("node10")
            built.down()
            left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert "bcminv" not in left
        srv.stop()


def test_lab_cli_registers_nodes_ready_for_inventory(lab_required: None, tmp_path: Path) -> None:
    """`bcm lab up` registers its nodes (MAC, IP, host key) so `bcm node inventory` works right after."""
    srv = Server(tmp_path / "state")
    srv.start()
    lab_args = ["--state-dir", str(tmp_path / "lab"), "--name", "bcmcli"]
    try:
        up = srv.cli(
            "lab", "up", "--nodes", "3", *lab_args, "--subnet", "198.18.8.0/24", "--category", "gpu", "--json"
        )
        assert up.returncode == 0, up.stderr
        lab_nodes = json.loads(up.stdout)
        registered = {n["name"]: n for n in json.loads(srv.cli("node", "list", "--json").stdout)}
        for n in lab_nodes:
            assert registered[n["name"]]["interfaces"][0]["mac"] == n["mac"]
            assert registered[n["name"]]["interfaces"][0]["ip"] == n["ip"]
            assert registered[n["name"]]["category"] == "gpu"
        inv = srv.cli("node", "inventory", "node[01-03]")
        assert inv.returncode == 0, inv.stdout + inv.stderr
        status = json.loads(srv.cli("lab", "status", *lab_args, "--json").stdout)
        assert [n["alive"] for n in status] == [True, True, True]
        assert srv.cli("lab", "up", "--nodes", "2", *lab_args, "--subnet", "203.0.113.0/24").returncode == 1
    finally:
        down = srv.cli("lab", "down", *lab_args)
        srv.stop()
    assert down.returncode == 0, down.stderr
    assert not [
        ns
        for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        if ns.startswith("bcmcli")
    ]
