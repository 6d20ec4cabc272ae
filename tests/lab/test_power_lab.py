"""Lab VMs powered through bcm: qemu behind a real ipmi_sim (IPMI) and a real sushy-tools (Redfish) BMC.

The BMCs listen on lab addresses on the bridge; bcm reaches them over the head's veth like real ones.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bcm.lab import Lab, procs, vm
from bcm.lab.chassis import Machine

pytestmark = pytest.mark.lab


def qemu_cmdline(machine: Machine) -> list[str]:
    pid = machine.pid()
    assert pid is not None
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    assert argv[0].endswith("qemu-system-x86_64")
    return argv


def wait_op(api: Any, op_id: int) -> dict[str, Any]:
    for _ in range(900):
        op = api.get(f"/api/v1/operations/{op_id}").json()
        if op["state"] not in ("pending", "running"):
            return dict(op)
        time.sleep(0.1)
    raise AssertionError(f"operation {op_id} did not finish")


def power(api: Any, action: str, nodes: str) -> dict[str, Any]:
    r = api.post(f"/api/v1/nodes/actions/power-{action}", json={"nodes": nodes})
    assert r.status_code == 200, r.text
    return wait_op(api, r.json()["operation_id"])


@pytest.fixture
def vm_lab(lab_required: None, tmp_path: Path) -> Iterator[tuple[Lab, list[vm.LabVm]]]:
    missing = [t for t in ("ipmi_sim", "ipmitool", "qemu-system-x86_64") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    built = Lab(tmp_path / "lab", "pwlab", subnet="198.18.60.0/24")
    built.up(0, [], vms=2)
    try:
        yield built, vm.load(built.state_dir)
    finally:
        built.down()


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Any]:
    from fastapi.testclient import TestClient

    from bcm.api.app import create_app
    from bcm.server import prepare
    from bcm.settings import Settings

    settings = Settings(state_dir=tmp_path / "state", database_url=f"sqlite:///{tmp_path / 'bcm.db'}")
    settings.power.timeout_s = 15  # the BMCs run a Python program per command on two busy cores
    settings.power.retries = 1
    engine, _ = prepare(settings)
    with TestClient(create_app(settings, engine)) as client:
        client.headers["Authorization"] = f"Bearer {settings.admin_token_file.read_text().strip()}"
        yield client
    engine.dispose()


def test_vms_power_on_off_cycle_and_pxe_through_both_protocols(
    vm_lab: tuple[Lab, list[vm.LabVm]], api: Any
) -> None:
    lab, vms = vm_lab
    assert [v.bmc.kind for v in vms] == ["ipmi", "redfish"]
    for v in vms:
        body = {
            "name": v.name,
            "mac": v.mac,
            "bmc_address": v.bmc.address,
            "bmc_protocol": v.bmc.kind,
            "bmc_user": v.bmc.user,
        }
        assert api.post("/api/v1/nodes", json=body).status_code == 201
        api.put("/api/v1/nodes/bmc-password", json={"nodes": v.name, "password": v.bmc.password})
    machines = {v.name: Machine(v.bmc.dir) for v in vms}
    assert all(m.pid() is None for m in machines.values())

    op = power(api, "status", "vm[01-02]")
    assert {n: r.get("power") for n, r in op["results"].items()} == {"vm01": "off", "vm02": "off"}, op

    op = power(api, "on", "vm[01-02]")
    assert op["state"] == "succeeded", op
    for name, machine in machines.items():
        argv = qemu_cmdline(machine)
        assert argv[argv.index("-name") + 1] == name and argv[argv.index("-boot") + 1] == "c"
    op = power(api, "status", "vm[01-02]")
    assert {n: r["power"] for n, r in op["results"].items()} == {"vm01": "on", "vm02": "on"}
    listed = api.get("/api/v1/nodes", params={"nodes": "vm[01-02]"}).json()["items"]
    assert {n["name"]: n["power_state"] for n in listed} == {"vm01": "on", "vm02": "on"}

    before = {name: m.pid() for name, m in machines.items()}
    op = power(api, "pxe", "vm[01-02]")  # next boot from the network, then a fresh start
    assert op["state"] == "succeeded", op
    for name, machine in machines.items():
        for _ in range(100):  # ipmi_sim switches the power back on a second after a cycle's off
            if machine.pid() not in (None, before[name]):
                break
            time.sleep(0.1)
        argv = qemu_cmdline(machine)
        assert machine.pid() != before[name] and argv[argv.index("-boot") + 1] == "n", name

    op = power(api, "off", "vm[01-02]")
    assert op["state"] == "succeeded", op
    assert all(m.pid() is None for m in machines.values())
    op = power(api, "status", "vm[01-02]")
    assert {n: r["power"] for n, r in op["results"].items()} == {"vm01": "off", "vm02": "off"}

    op = power(api, "cycle", "vm02")  # from off: on
    assert op["state"] == "succeeded" and machines["vm02"].pid() is not None
    assert machines["vm01"].pid() is None

    lab.down()
    leftovers = [
        pid
        for pid in procs.all_pids()
        if pid != os.getpid()
        and str(lab.state_dir) in _cmdline(pid)
        or "qemu-system" in _cmdline(pid)
        and "vm0" in _cmdline(pid)
    ]
    assert leftovers == []
    assert (
        not any(ns.startswith("pwlab") for ns in os.listdir("/run/netns"))
        if os.path.isdir("/run/netns")
        else True
    )


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
