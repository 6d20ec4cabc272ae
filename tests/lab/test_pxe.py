"""PXE end to end with real parts: `bcm serve` supervising a real dnsmasq on the lab's provisioning
interface, two qemu VMs (unknown MACs, behind an IPMI and a Redfish BMC emulator) that PXE-boot from qemu's
iPXE ROM, the discovery image, `bcm node assign`, `bcm node provision` (BMC: next boot PXE, power-cycle),
a stateless boot of an image built by `bcm image build`, the callback, and an SSH inventory with the host
key bcm pinned before the first contact, and `bcm wlm deploy slurm` with a namespace node as the controller
and the two VMs as its nodes (Ansible over SSH, registration, the verification job).

Every step is a documented command (`bcm lab up --vms 2 --discover-vms`, `bcm lab vm-power on --pxe`,
`bcm node discovered|assign|provision`, `bcm lab vm-bmc`, `bcm pxe enable`); TCG VMs are slow, so
each wait is long but bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bcm.devserver import BCM, REPO, Server
from bcm.lab import vm
from bcm.lab.lab import Lab
from tests.lab.test_health_e2e import until

pytestmark = pytest.mark.lab

NAME, SUBNET, HEAD = "pxlab", "198.18.80.0/24", "198.18.80.1"
IMAGE = "lab"
BOOT_WAIT_S = 1500


class Run:
    def __init__(self, server: Server, lab: Lab) -> None:
        self.server, self.lab = server, lab

    def cli(self, *args: str, timeout: float = 1800, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*BCM, *args], env=self.server.env(), cwd=REPO, capture_output=True, text=True,
                              timeout=timeout, check=False)  # fmt: skip
        if check:
            assert done.returncode == 0, (args, done.stdout[-3000:], done.stderr[-3000:])
        return done

    def json(self, *args: str, **kw: Any) -> Any:
        return json.loads(self.cli(*args, "--json", **kw).stdout)

    def serial(self, name: str) -> str:
        path = self.lab.state_dir / "vms" / name / "serial.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else "(no serial log)"


@pytest.fixture
def run(tmp_path: Path, lab_required: None) -> Iterator[Run]:
    work = tmp_path / "pxe"
    server = Server(
        work / "state",
        extra_env={
            "BCM_SSH__CONNECT_TIMEOUT_S": "10",
            "BCM_SSH__COMMAND_TIMEOUT_S": "300",
        },
        host="0.0.0.0",
    )
    lab = Lab(server.state_dir / "lab" / NAME, NAME, subnet=SUBNET)
    r = Run(server, lab)
    try:
        server.start()
        r.cli("lab", "up", "--nodes", "1", "--gpus", "0", "--vms", "2", "--discover-vms", "--name", NAME,
              "--subnet", SUBNET, "--json")  # fmt: skip
        r.cli("pxe", "enable", "--interface", f"{NAME}-prov", "--address", HEAD, "--range", "198.18.80.100-198.18.80.150")
        yield r
    finally:
        try:
            subprocess.run([*BCM, "lab", "down", "--name", NAME], env=server.env(), cwd=REPO, capture_output=True,
                           timeout=300, check=False)  # fmt: skip
            lab.down()
        finally:
            server.stop()


def dnsmasq_pid(run: Run) -> int | None:
    try:
        return int((run.server.state_dir / "pxe" / "dnsmasq.pid").read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return None


@pytest.mark.timeout(3 * BOOT_WAIT_S)
def test_discover_assign_provision_boot_inventory_and_join_slurm(run: Run, tmp_path: Path) -> None:
    run.cli("image", "build", IMAGE, timeout=3600)  # exit 0 checked by cli()
    vms = vm.load(run.lab.state_dir)
    by_mac = {v.mac: v for v in vms}

    # dnsmasq killed: the supervisor starts it again, and the boots below still succeed
    first = until("dnsmasq to run", lambda: dnsmasq_pid(run), 30, 0.5)
    os.kill(first, signal.SIGKILL)
    until("dnsmasq to be restarted", lambda: (p := dnsmasq_pid(run)) not in (None, first) and Path(f"/proc/{p}").exists(),
          60, 0.5)  # fmt: skip

    # two machines nobody registered: powered on through their BMCs, network boot
    run.cli("lab", "vm-power", "on", "--pxe", "--name", NAME)
    found = run.json("node", "discovered", "--wait", "2", "--timeout", str(BOOT_WAIT_S), timeout=BOOT_WAIT_S + 60)
    assert {d["mac"] for d in found} == set(by_mac), found
    for d in found:
        assert d["threads"] == 1 and d["memory_bytes"] > 1 << 30 and d["product"], d

    names = {}
    for i, v in enumerate(sorted(vms, key=lambda x: x.name), 1):
        name = f"pxn{i:02d}"
        names[name] = v
        node = run.json("node", "assign", v.mac, "--name", name, "--category", "gpu", "--image", IMAGE)
        assert node["provision_state"] == "registered" and node["category"] == "gpu", node
        run.cli("lab", "vm-bmc", v.name, name, "--name", NAME)
    assert run.json("node", "discovered") == []

    started = time.monotonic()
    done = run.cli("node", "provision", "pxn[01-02]", "--wait", "--timeout", str(BOOT_WAIT_S), "--json",
                   timeout=BOOT_WAIT_S + 120, check=False)  # fmt: skip
    states = json.loads(done.stdout) if done.stdout.strip().startswith("{") else {}
    assert done.returncode == 0, (states, done.stderr[-2000:], {n: run.serial(v.name) for n, v in names.items()})
    assert {n["name"]: n["state"] for n in states["nodes"]} == {"pxn01": "booted", "pxn02": "booted"}
    print(f"provision → booted: {time.monotonic() - started:.0f} s for 2 VMs")

    # inventoried over SSH, with the host key bcm generated and pinned before the first boot
    def inventoried(name: str) -> Any:
        n = run.json("node", "show", name)
        return n if n.get("inventoried_at") else None

    for name in names:
        n = until(f"{name} to be inventoried", lambda name=name: inventoried(name), 600, 5)
        assert n["provision_state"] == "booted"
        assert n["interfaces"][0]["ip"].startswith("198.18.80.1")
    # the node answers with exactly the key bcm pinned (read from the server's database)
    import sqlite3

    key = run.server.state_dir / "ssh" / "id_ed25519"
    with sqlite3.connect(run.server.state_dir / "bcm.db") as db:
        pins = dict(db.execute("SELECT name, ssh_host_key FROM node WHERE name LIKE 'pxn%'").fetchall())
    for name in names:
        ip = run.json("node", "show", name)["interfaces"][0]["ip"]
        assert pins[name] and pins[name].startswith("ssh-ed25519 ")
        known = tmp_path / f"kh-{name}"
        known.write_text(f"{ip} {pins[name]}\n")
        ssh = subprocess.run(
            ["ssh", "-i", str(key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
             "-o", f"UserKnownHostsFile={known}", "-o", "ConnectTimeout=10", f"root@{ip}", "hostname"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert ssh.returncode == 0 and ssh.stdout.strip() == name, ssh.stderr

    # they join the lab's Slurm: node01 (a namespace node) runs slurmctld and slurmdbd, the two booted VMs
    # are its nodes (`bcm lab vm-bmc` counted them among the lab's nodes, so the lab's settings apply)
    run.cli("node", "inventory", "node01", timeout=600)
    done = run.cli("wlm", "deploy", "slurm", "--name", "pxe", "--controller", "node01", "--nodes", "pxn[01-02]",
                   "--json", timeout=3600, check=False)  # fmt: skip
    op = json.loads(done.stdout) if done.stdout.strip().startswith("{") else {}
    if done.returncode != 0 or op.get("state") != "succeeded":
        print("deploy:", done.stderr[-2000:], op.get("error"), json.dumps(op.get("results"), indent=1),
              (op.get("log") or "")[-4000:], sep="\n")  # fmt: skip
        for argv in (["sinfo", "-N", "-o", "%N %T %E"], ["scontrol", "show", "node"],
                     ["tail", "-n", "60", "/var/log/slurm/slurmctld.log"]):  # fmt: skip
            shown = run.lab.run("node01", argv, timeout=60)
            print("node01$", *argv, shown.stdout, shown.stderr, sep="\n")
        for name in names:
            ip = run.json("node", "show", name)["interfaces"][0]["ip"]
            shown = subprocess.run(
                ["ssh", "-i", str(key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                 "-o", f"UserKnownHostsFile={tmp_path / f'kh-{name}'}", "-o", "ConnectTimeout=10", f"root@{ip}",
                 "tail -n 40 /var/log/slurm/slurmd.log; systemctl --no-pager status slurmd munge | tail -n 30"],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            print(f"{name}$ slurmd.log", shown.stdout, shown.stderr, sep="\n")
    assert done.returncode == 0 and op.get("state") == "succeeded", (op.get("error"), op.get("results"))
    assert "verify: passed" in op["log"], op["log"][-3000:]
    cluster = run.json("wlm", "status", "pxe")
    assert {m["name"]: m["wlm_state"] for m in cluster["members"]} == {"pxn01": "idle", "pxn02": "idle"}, cluster
