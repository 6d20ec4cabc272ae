"""Power through the API: roles, write-only BMC passwords, operations with per-node results, events.

The BMCs are real emulators on loopback (ipmi_sim, sushy-tools) powering stand-in processes.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from bcm.lab import bmc
from bcm.lab.chassis import Machine

PASSWORD = "Pw-for-bmc-77"


def make_token(api: Any, role: str) -> str:
    r = api.post("/api/v1/tokens", json={"name": f"{role}-power", "role": role})
    assert r.status_code == 201, r.text
    return str(r.json()["token"])


def wait_op(api: Any, op_id: int) -> dict[str, Any]:
    for _ in range(600):
        op = api.get(f"/api/v1/operations/{op_id}").json()
        if op["state"] not in ("pending", "running"):
            return dict(op)
        time.sleep(0.1)
    raise AssertionError(f"operation {op_id} did not finish")


def power(api: Any, action: str, nodes: str, **headers: str) -> Any:
    return api.post(f"/api/v1/nodes/actions/power-{action}", json={"nodes": nodes}, headers=headers or None)


def free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def bmcs(tmp_path: Path) -> Iterator[dict[str, bmc.BmcSpec]]:
    """One ipmi_sim and one sushy-tools BMC on loopback, each powering a sleeping process."""
    if not (shutil.which("ipmi_sim") and shutil.which("ipmitool")):
        pytest.skip("needs ipmi_sim (openipmi) and ipmitool")
    specs, procs = {}, []
    for kind, sock in (("ipmi", socket.SOCK_DGRAM), ("redfish", socket.SOCK_STREAM)):
        spec = bmc.BmcSpec(
            kind, f"m-{kind}", "127.0.0.1", free_port(sock), "admin", PASSWORD, str(tmp_path / kind)
        )
        bmc.write_machine(spec, [sys.executable, "-c", "import time; time.sleep(3600)", "machine-{boot}"])
        procs.append((bmc.start(spec), spec))
        specs[kind] = spec
    try:
        yield specs
    finally:
        for proc, spec in procs:
            bmc.stop(proc.pid, spec.dir)


@pytest.fixture
def fast_power(settings: Any) -> Any:
    settings.power.timeout_s = 8
    settings.power.retries = 1
    return settings


def register(api: Any, name: str, spec: bmc.BmcSpec | None, address: str | None = None) -> None:
    body: dict[str, Any] = {"name": name}
    if spec is not None or address is not None:
        body |= {
            "bmc_address": address or spec.address,  # type: ignore[union-attr]
            "bmc_protocol": spec.kind if spec else "ipmi",
            "bmc_user": "admin",
        }
    assert api.post("/api/v1/nodes", json=body).status_code == 201


def test_power_needs_operator_and_passwords_need_admin(api: Any) -> None:
    register(api, "p1", None)
    viewer, operator = make_token(api, "viewer"), make_token(api, "operator")
    assert power(api, "status", "p1", Authorization=f"Bearer {viewer}").status_code == 403
    r = power(api, "status", "p1", Authorization=f"Bearer {operator}")
    assert r.status_code == 200 and r.json()["operation_id"]
    op = wait_op(api, r.json()["operation_id"])
    assert op["results"]["p1"]["status"] == "no_bmc" and op["created_by"] == "operator:operator-power"
    r = api.put(
        "/api/v1/nodes/bmc-password",
        json={"nodes": "p1", "password": PASSWORD},
        headers={"Authorization": f"Bearer {operator}"},
    )
    assert r.status_code == 403
    assert power(api, "sideways", "p1").status_code == 422
    assert power(api, "on", "nope1").status_code == 404


def test_password_is_write_only_and_encrypted_at_rest(
    api: Any, engine: Any, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    assert (
        api.post(
            "/api/v1/categories", json={"name": "bmcs", "bmc_protocol": "ipmi", "bmc_user": "root"}
        ).status_code
        == 201
    )
    register(api, "p2", None)
    assert (
        api.patch("/api/v1/nodes/p2", json={"category": "bmcs", "bmc_address": "127.0.0.1:1"}).status_code
        == 200
    )
    assert api.put("/api/v1/nodes/bmc-password", json={"nodes": "p2", "password": PASSWORD}).json() == {
        "updated": 1
    }
    assert api.put("/api/v1/categories/bmcs/bmc-password", json={"password": PASSWORD}).status_code == 200

    seen = [
        api.get("/api/v1/nodes/p2").text,
        api.get("/api/v1/nodes").text,
        api.get("/api/v1/categories/bmcs").text,
        api.get("/api/v1/categories").text,
        api.get("/api/v1/events").text,
        api.get("/openapi.json").text,
    ]
    node = api.get("/api/v1/nodes/p2").json()
    assert node["effective"]["bmc_user"] == "root" and node["effective"]["bmc_protocol"] == "ipmi"
    assert all(PASSWORD not in page for page in seen)
    assert all("bmc_password" not in page for page in seen[:4])
    with engine.connect() as conn:
        stored = [r[0] for r in conn.execute(text("SELECT bmc_password_enc FROM node WHERE name = 'p2'"))]
        stored += [
            r[0] for r in conn.execute(text("SELECT bmc_password_enc FROM category WHERE name = 'bmcs'"))
        ]
    assert all(s and PASSWORD not in s for s in stored)
    key = settings.state_dir / "secret.key"
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert PASSWORD not in caplog.text


def test_power_operations_move_real_machines_and_record_events(
    api: Any, bmcs: dict[str, bmc.BmcSpec], fast_power: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    register(api, "pi1", bmcs["ipmi"])
    register(api, "pr1", bmcs["redfish"])
    api.put("/api/v1/nodes/bmc-password", json={"nodes": "pi1,pr1", "password": PASSWORD})
    ipmi_machine, redfish_machine = Machine(bmcs["ipmi"].dir), Machine(bmcs["redfish"].dir)

    op = wait_op(api, power(api, "on", "pi1,pr1").json()["operation_id"])
    assert op["state"] == "succeeded", op
    assert ipmi_machine.pid() is not None and redfish_machine.pid() is not None

    op = wait_op(api, power(api, "status", "pi1,pr1").json()["operation_id"])
    assert {n: r["power"] for n, r in op["results"].items()} == {"pi1": "on", "pr1": "on"}
    nodes = {n["name"]: n for n in api.get("/api/v1/nodes", params={"nodes": "pi1,pr1"}).json()["items"]}
    assert nodes["pi1"]["power_state"] == "on" and nodes["pr1"]["power_state"] == "on"

    op = wait_op(api, power(api, "off", "pi1,pr1").json()["operation_id"])
    assert op["state"] == "succeeded", op
    assert ipmi_machine.pid() is None and redfish_machine.pid() is None
    assert api.get("/api/v1/nodes/pi1").json()["power_state"] == "off"

    events = api.get("/api/v1/events", params={"action": "node.power_on"}).json()
    assert {e["target"] for e in events} == {"pi1", "pr1"}
    assert all(e["actor"] == "admin:bootstrap" or e["actor"].startswith("admin:") for e in events)
    assert api.get("/api/v1/events", params={"action": "node.power_off"}).json()
    assert PASSWORD not in caplog.text
    assert all(PASSWORD not in api.get(f"/api/v1/operations/{i}").text for i in range(1, 4))


def test_bad_bmcs_fail_alone_and_the_batch_finishes(
    api: Any, bmcs: dict[str, bmc.BmcSpec], fast_power: Any
) -> None:
    fast_power.power.timeout_s = 2
    register(api, "good1", bmcs["ipmi"])
    register(api, "wrongpw1", bmcs["redfish"])
    register(api, "silent1", None, address=f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}")
    register(api, "nobmc1", None)
    api.put("/api/v1/nodes/bmc-password", json={"nodes": "good1,silent1", "password": PASSWORD})
    api.put("/api/v1/nodes/bmc-password", json={"nodes": "wrongpw1", "password": "not-the-password"})

    op = wait_op(api, power(api, "on", "good1,wrongpw1,silent1,nobmc1").json()["operation_id"])
    results = op["results"]
    assert op["state"] == "partial" and op["progress_done"] == 4
    assert results["good1"]["status"] == "ok" and Machine(bmcs["ipmi"].dir).pid() is not None
    assert results["wrongpw1"]["status"] == "auth_failed" and results["wrongpw1"]["attempts"] == 1
    assert Machine(bmcs["redfish"].dir).pid() is None
    assert results["silent1"]["status"] == "unreachable" and results["silent1"]["attempts"] == 2
    assert "silent1" in results["silent1"]["message"] and "127.0.0.1" in results["silent1"]["message"]
    assert results["nobmc1"]["status"] == "no_bmc"
    failed = api.get("/api/v1/events", params={"action": "node.power_on"}).json()
    severities = {e["target"]: e["severity"] for e in failed}
    assert severities == {"good1": "info", "wrongpw1": "error", "silent1": "error", "nobmc1": "error"}


def test_a_node_that_should_run_but_is_off_raises_an_event(
    api: Any, engine: Any, settings: Any, bmcs: dict[str, bmc.BmcSpec], fast_power: Any
) -> None:
    import asyncio

    from bcm.workers import power as worker

    register(api, "up1", bmcs["ipmi"])
    api.put("/api/v1/nodes/bmc-password", json={"nodes": "up1", "password": PASSWORD})
    with engine.begin() as conn:
        conn.execute(text("UPDATE node SET provision_state = 'ready', power_state = 'on' WHERE name = 'up1'"))
    assert asyncio.run(worker.poll_once(engine, settings)) == 1
    assert api.get("/api/v1/nodes/up1").json()["power_state"] == "off"
    events = api.get("/api/v1/events", params={"action": "node.power_unexpected_off"}).json()
    assert [e["target"] for e in events] == ["up1"] and events[0]["severity"] == "warning"
    assert asyncio.run(worker.poll_once(engine, settings)) == 1  # still off: no second event
    assert len(api.get("/api/v1/events", params={"action": "node.power_unexpected_off"}).json()) == 1
