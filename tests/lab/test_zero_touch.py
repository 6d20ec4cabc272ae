"""Zero-touch end to end (#29), as the README's flow runs it, verbatim: `bcm serve` with a real dnsmasq on
the lab's provisioning interface, four qemu VMs with unknown MACs behind IPMI and Redfish BMC emulators that
name themselves in SMBIOS, one category with a discovery rule, auto-provisioning, BMC credentials bound to
the BMC range, and a Slurm cluster with a namespace controller. After `bcm lab vm-power on --pxe` (the power
buttons) no bcm command runs: the three good VMs are discovered, registered, provisioned through the BMCs
they reported, booted, inventoried, joined to Slurm by one deploy and verified one by one → `ready`; the
fourth, whose category's image is broken (`lab-broken`: the lab image without /sbin/init), boots as far as
bcm's initramfs, which reports the failure itself, and ends `failed` with that line in `last_error`,
delaying nobody. Then this test checks what the flow did: states, the BMCs taken from the reports, the SSH
host keys bcm pinned before the first boot, Slurm's view, and that every operation on those nodes was started
by bcm itself. On the way, dnsmasq is killed before the power buttons: `bcm serve` starts it again, and the
boots succeed. (The manual PXE chain, `bcm node assign|provision` and `bcm lab vm-bmc`, runs verbatim in
tests/lab/test_readme.py; this test replaced tests/lab/test_pxe.py, which booted two more VMs for it.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bcm.devserver import BCM, REPO, Server
from bcm.domain.naming import expand_hostlist
from bcm.lab.lab import Lab
from tests.lab.test_health_e2e import until
from tests.lab.test_readme import ERROR, README, sh_lines

pytestmark = pytest.mark.lab

COMMAND_TIMEOUT_S = 2700
GOOD = ["zt01", "zt02", "zt03"]


class Flow:
    def __init__(self, server: Server, work: Path) -> None:
        self.server, self.work = server, work
        self.transcript: list[str] = []

    def sh(self, line: str) -> None:
        done = subprocess.run(
            ["bash", "-o", "pipefail", "-c", line],
            cwd=self.work,
            env=self.server.env(),
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
        output = done.stdout + done.stderr
        self.transcript.append(f"$ {line}\n{output[-4000:]}")
        if done.returncode != 0 or ERROR.search(output):
            pytest.fail(
                f"README command failed (exit {done.returncode}): {line}\n\n"
                + "\n".join(self.transcript[-3:])
                + "\n\nserver log:\n"
                + self.server_log()
            )

    def json(self, *args: str) -> Any:
        done = subprocess.run(
            [*BCM, *args, "--json"],
            env=self.server.env(),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, (args, done.stderr[-2000:])
        return json.loads(done.stdout)

    def server_log(self) -> str:
        log = getattr(self.server, "log", None)
        return Path(log).read_text(errors="replace")[-6000:] if log and Path(log).exists() else "(none)"


def dnsmasq_pid(flow: Flow) -> int | None:
    try:
        return int((flow.server.state_dir / "pxe" / "dnsmasq.pid").read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return None


def dnsmasq_dies_and_comes_back(flow: Flow) -> None:
    """dnsmasq killed: `bcm serve` supervises it and starts it again."""
    first = until("dnsmasq to run", lambda: dnsmasq_pid(flow), 30, 0.5)
    os.kill(first, signal.SIGKILL)
    until(
        "dnsmasq to be restarted",
        lambda: (p := dnsmasq_pid(flow)) not in (None, first) and Path(f"/proc/{p}").exists(),
        60,
        0.5,
    )


@pytest.fixture
def flow(tmp_path: Path, lab_required: None) -> Iterator[Flow]:
    with flow_at(tmp_path) as f:
        yield f


@contextlib.contextmanager
def flow_at(tmp_path: Path, extra_env: dict[str, str] | None = None) -> Iterator[Flow]:
    """A `bcm serve` on a fresh state directory and a work directory whose `.venv/bin/bcm` is this bcm; at
    the end PXE off, the lab down, the server stopped, the transcript kept beside them."""
    server = Server(tmp_path / "state", host="0.0.0.0", extra_env=extra_env or {})
    work = tmp_path / "work"
    work.mkdir()
    (work / ".venv").symlink_to(Path(sys.prefix))  # the README's `.venv/bin/bcm` is this environment's bcm
    f = Flow(server, work)
    try:
        server.start()
        yield f
    finally:
        (tmp_path / "transcript.txt").write_text("\n".join(f.transcript) + "\n")
        try:
            subprocess.run(
                [*BCM, "pxe", "disable"],
                env=server.env(),
                cwd=REPO,
                capture_output=True,
                timeout=120,
                check=False,
            )
            leftover = Lab(server.state_dir / "lab" / "bcmlab", "bcmlab")
            if leftover.is_up():
                leftover.down()
        finally:
            server.stop()


@pytest.mark.timeout(3 * COMMAND_TIMEOUT_S)
def test_power_on_to_ready_in_slurm_with_no_command(flow: Flow) -> None:
    lines = sh_lines(README.read_text(), "tests/lab/test_zero_touch.py")
    teardown = next(i for i, line in enumerate(lines) if "pxe disable" in line)
    power_on = next(i for i, line in enumerate(lines) if "vm-power on" in line)
    assert all(
        ".venv/bin/bcm node wait" in ln or "wlm status" in ln for ln in lines[power_on + 1 : teardown]
    ), "after the power buttons the flow only waits and reads"
    # the image the category names, built as the README's image section builds it
    flow.sh(next(ln for ln in sh_lines(README.read_text()) if "bcm image build lab" in ln))
    for i, line in enumerate(lines[:teardown]):
        if i == power_on:
            dnsmasq_dies_and_comes_back(flow)  # before the boots, which then still succeed
        flow.sh(line)

    nodes = {n: flow.json("node", "show", n) for n in [*GOOD, "bad01"]}
    for name in GOOD:
        n = nodes[name]
        assert n["provision_state"] == "ready" and n["category"] == "zt" and n["last_error"] is None, n
        assert n["bmc_address"] and n["bmc_protocol"] in ("ipmi", "redfish"), (
            n
        )  # taken from its discovery report
        assert n["inventoried_at"] and n["interfaces"][0]["ip"].startswith("198.18.0."), n
    bad = nodes["bad01"]
    assert bad["provision_state"] == "failed" and bad["category"] == "bad", bad
    # the init's own report (POST /boot/v1/failed with the attempt's token), not the power poll or a deadline
    assert "the boot failed on the node" in bad["last_error"], bad["last_error"]
    assert "bcm-init: the root image has no /sbin/init" in bad["last_error"], bad["last_error"]

    # each answers SSH with exactly the host key bcm made and pinned before its first boot
    with sqlite3.connect(flow.server.state_dir / "bcm.db") as db:
        pins = dict(db.execute("SELECT name, ssh_host_key FROM node WHERE name LIKE 'zt%'").fetchall())
    key = flow.server.state_dir / "ssh" / "id_ed25519"
    for name in GOOD:
        ip = nodes[name]["interfaces"][0]["ip"]
        assert pins[name] and pins[name].startswith("ssh-ed25519 ")
        known = flow.work / f"kh-{name}"
        known.write_text(f"{ip} {pins[name]}\n")
        ssh = subprocess.run(
            [
                "ssh",
                "-i",
                str(key),
                "-o",
                "BatchMode=yes",
                "-o",
                "StrictHostKeyChecking=yes",
                "-o",
                f"UserKnownHostsFile={known}",
                "-o",
                "ConnectTimeout=10",
                f"root@{ip}",
                "hostname",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert ssh.returncode == 0 and ssh.stdout.strip() == name, ssh.stderr

    cluster = flow.json("wlm", "status", "zt")
    states = {m["name"]: m["wlm_state"] for m in cluster["members"]}
    assert {n: states.get(n) for n in GOOD} == dict.fromkeys(GOOD, "idle"), cluster
    assert "bad01" not in states

    # nobody typed a command for these nodes: every operation that touched them was bcm's own
    ops = flow.json("op", "list", "--limit", "200")
    ops = ops["items"] if isinstance(ops, dict) else ops
    touching = [o for o in ops if o["targets"] and set(expand_hostlist(o["targets"])) & {*GOOD, "bad01"}]
    assert touching and all((o["created_by"] or "").startswith("bcm:") for o in touching), [
        (o["kind"], o["targets"], o["created_by"]) for o in touching
    ]
    kinds = {o["kind"] for o in touching}
    assert {"provision", "inventory"} <= kinds, kinds
    joins = [o for o in ops if o["kind"] == "wlm.deploy" and o["created_by"] == "bcm:zero-touch"]
    assert joins and all(o["state"] == "succeeded" for o in joins), joins
    assert len(joins) <= 2, joins  # the rack joined in one deploy (two at most when one VM lagged by minutes)

    for line in lines[teardown:]:
        flow.sh(line)
