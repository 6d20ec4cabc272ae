"""GPU health end to end on real lab nodes: bcm deploys its agent over SSH, agents report from a fake NVML,
a failing report drains the node in the lab's Slurm (with a ``bcm:`` reason) and shows in the health API,
the node resumes after healthy reports, and a drain an admin made in Slurm is left alone.
"""

from __future__ import annotations

import copy
import json
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from bcm.lab import fakegpu
from bcm.lab.fakegpu import RECORDED_NVML
from bcm.lab.slurm import SlurmLab

pytestmark = pytest.mark.lab

NVML = RECORDED_NVML / "h100_sxm_565.json"
INTERVAL_S = 2.0
GPUS = 2


def fixture_for(node: str) -> dict[str, Any]:
    """The recorded H100 fake NVML, cut to the node's inventoried GPUs with their UUIDs."""
    data = json.loads(NVML.read_text())
    gpus = [copy.deepcopy(data["gpus"][i % len(data["gpus"])]) for i in range(GPUS)]
    for i, g in enumerate(gpus):
        g["uuid"] = fakegpu.gpu_uuid(node, i)
    data["gpus"] = gpus
    data.pop("xid_events", None)
    return data


def until(what: str, check: Callable[[], Any], timeout_s: float = 90, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:  # bounded by timeout_s
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


def sinfo_reasons(run: SlurmLab) -> dict[str, str]:
    done = run.lab.run(run.controller, ["sinfo", "-R", "--noheader", "--format=%N|%E"])
    assert done.returncode == 0, done.stderr
    return dict(line.split("|", 1) for line in done.stdout.splitlines() if "|" in line)


def failing_report(node: str) -> dict[str, Any]:
    from bcm.agent.collector import collect
    from bcm.agent.fake_nvml import FakeNvml

    nv = FakeNvml(fixture_for(node))
    nv.init()
    rep: dict[str, Any] = dict(collect(nv, GPUS, hostname=node))
    nv.shutdown()
    g = rep["gpus"][0]
    rep["xid_events"] = [
        {
            "xid": 79,
            "gpu_index": 0,
            "uuid": g["uuid"],
            "pci_bus_id": g["pci_bus_id"],
            "time": rep["collected_at"],
            "source": "nvml",
            "message": "GPU has fallen off the bus",
            "recovery_action": None,
        }
    ]
    return rep


def stop_agent(run: SlurmLab, node: str) -> None:
    run.lab.run(node, ["sh", "-c", 'kill "$(cat /run/bcm-agent.pid)"; sleep 1'])


def start_agent(run: SlurmLab, node: str) -> None:
    done = run.lab.run(
        node,
        ["sh", "-c", "setsid sh /opt/bcm/bcm-agent-supervise </dev/null >>/var/log/bcm-agent.log 2>&1 &"],
    )
    assert done.returncode == 0, done.stderr


def test_agents_report_fail_drains_in_slurm_recovery_resumes_admin_drain_stays(
    lab_required: None, tmp_path: Path
) -> None:
    with SlurmLab.running(
        tmp_path,
        nodes=3,
        gpus_per_node=GPUS,
        name="bcmhealth",
        subnet="198.18.7.0/24",
        server_host="0.0.0.0",
    ) as run:
        http: httpx.Client = run.http
        sick, admins = run.compute  # node02, node03
        op = run.deploy(verify=False)
        assert op["state"] == "succeeded", op

        # the agent onto every compute node, over SSH, each answering from its own fake NVML
        url = f"http://{run.lab.head_ip}:{run.server.port}"
        for node in run.compute:
            body = {
                "nodes": node,
                "server_url": url,
                "interval_s": INTERVAL_S,
                "nvml_fixture": fixture_for(node),
            }
            started = http.post("/api/v1/agents/deploy", json=body)
            assert started.status_code == 202, started.text
            done = run.wait(started.json()["operation_id"], timeout_s=180)
            assert done["state"] == "succeeded", done
        for node in run.compute:
            mode = run.lab.run(node, ["stat", "-c", "%a", "/etc/bcm/agent.json"]).stdout.strip()
            assert stat.S_IMODE(int(mode, 8)) == 0o600
        until(
            "both agents to report OK",
            lambda: http.get("/api/v1/health").json()["nodes_by_verdict"]["OK"] == 2,
        )
        gpus = http.get(f"/api/v1/nodes/{sick}/gpus").json()
        assert [g["uuid"] for g in gpus] == [fakegpu.gpu_uuid(sick, i) for i in range(GPUS)]
        assert {g["verdict"] for g in gpus} == {"OK"}

        # an admin drains node03 in Slurm by hand
        admin = run.lab.run(
            run.controller,
            ["scontrol", "update", f"NodeName={admins}", "State=DRAIN", "Reason=admin: fan swap"],
        )
        assert admin.returncode == 0, admin.stderr

        # a failing report (Xid 79 on GPU 0) with each node's own token, the agents paused meanwhile
        for node in run.compute:
            stop_agent(run, node)
            token = json.loads(run.lab.run(node, ["cat", "/etc/bcm/agent.json"]).stdout)["token"]
            r = httpx.post(
                f"{run.server.url}/boot/v1/agent/report",
                json=failing_report(node),
                headers={"Authorization": f"Bearer {token}"},
            )
            assert r.status_code == 202 and r.json()["verdict"] == "FAIL", r.text

        uuid0 = fakegpu.gpu_uuid(sick, 0)
        reasons = until("Slurm to show bcm's drain", lambda: (s := sinfo_reasons(run)).get(sick) and s)
        assert reasons[sick].startswith(f"bcm: GPU 0 {uuid0} XID 79"), reasons
        assert reasons[admins] == "admin: fan swap", reasons  # not overwritten
        summary = http.get("/api/v1/health").json()
        assert summary["failing"] == [sick, admins] and summary["nodes_by_verdict"]["FAIL"] == 2
        assert summary["nodes_drained_by_bcm"] >= 1
        until(
            "bcm to record that it left the admin's drain alone",
            lambda: any(
                "left alone" in e["message"]
                for e in http.get("/api/v1/health/events", params={"node": admins}).json()
            ),
        )

        # recovery: the agents report healthy again; bcm resumes its own drain only
        for node in run.compute:
            start_agent(run, node)
        until("bcm to resume its drain in Slurm", lambda: sick not in sinfo_reasons(run), timeout_s=120)
        until(
            "the node to be OK again",
            lambda: (
                http.get("/api/v1/health/nodes", params={"nodes": sick}).json()["items"][0]["verdict"] == "OK"
            ),
        )
        time.sleep(INTERVAL_S * 4)  # well past resume_after_ok_intervals for node03 too
        assert sinfo_reasons(run).get(admins) == "admin: fan swap"
        assert http.get("/metrics", params={"nodes": sick}).text.count("DCGM_FI_DEV_GPU_TEMP{") == GPUS
