"""Slurm deployed by bcm onto real lab nodes: inventory with fake GPUs, deploy through the API (Ansible
over SSH, slurmdbd on the host's MariaDB), verification job, GPU accounting, drain and resume through
bcm, an idempotent second deploy, and the bad inputs (not inventoried, controller unreachable).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bcm.db import make_engine
from bcm.lab import accounting, fakegpu
from bcm.lab.slurm import SlurmLab
from bcm.settings import Settings
from bcm.workers import wlm as wlm_jobs

pytestmark = pytest.mark.lab


def explain(op: dict[str, Any]) -> str:
    return f"{op['state']}: {op.get('error')}\n{op.get('results')}\n{op.get('log', '')[-4000:]}"


def sync_once(run: SlurmLab) -> None:
    """One pass of the periodic state sync, in this process, against the server's database."""
    settings = Settings(state_dir=run.server.state_dir)
    engine = make_engine(settings.effective_database_url)
    stops = iter([False, True])
    try:
        asyncio.run(wlm_jobs.loop(engine, settings, 0, stop=lambda: next(stops)))
    finally:
        engine.dispose()


def sh(built: Any, node: str, *argv: str) -> str:
    done = built.run(node, list(argv), timeout=60)
    assert done.returncode == 0, f"{argv}: {done.stdout}{done.stderr}"
    return str(done.stdout)


@pytest.fixture
def slurm_lab(lab_required: None, tmp_path: Path) -> Iterator[SlurmLab]:
    with SlurmLab.running(tmp_path, nodes=4, name="bcmslurm", subnet="198.18.3.0/24") as run:
        yield run


def test_slurm_deploy_verify_drain_resume_redeploy(slurm_lab: SlurmLab) -> None:
    run, built, http = slurm_lab, slurm_lab.lab, slurm_lab.http
    compute = run.compute  # node[02-04]

    # inventory saw the fake GPUs
    for name in compute:
        hw = http.get(f"/api/v1/nodes/{name}/hardware").json()
        assert [g["uuid"] for g in hw["gpus"]] == [fakegpu.gpu_uuid(name, i) for i in range(2)]
        assert {g["name"] for g in hw["gpus"]} == {fakegpu.H100_NAME}

    # bad input first: a node that was never inventoried -> 409 naming it, nothing starts
    r = http.post("/api/v1/nodes", json={"name": "ghost01", "ip": "198.18.3.250"})
    assert r.status_code == 201, r.text
    r = http.post("/api/v1/wlm/slurm/deploy", json=run.deploy_body(nodes=f"{run.hostlist},ghost01"))
    assert r.status_code == 409 and "ghost01" in r.json()["message"], r.text
    assert http.get("/api/v1/wlm").json() == []

    # first deploy: Ansible, registration, verification job
    op = run.deploy()
    assert op["state"] == "succeeded", explain(op)
    results = op["results"]
    assert set(results) == {run.controller, *compute}
    assert all(r["status"] == "ok" for r in results.values()), results
    assert sum(r["changed"] for r in results.values()) > 0
    assert "verify: passed" in op["log"], op["log"]

    gres = sh(built, run.controller, "sinfo", "--noheader", "--Node", "--format=%N %T %G")
    rows = {line.split()[0]: line.split()[1:] for line in gres.splitlines()}
    assert rows == {n: ["idle", "gpu:h100:2"] for n in compute}, gres

    cluster = http.get("/api/v1/wlm/lab").json()
    assert cluster["state"] == "deployed" and cluster["last_verify_ok"] is True
    verify = cluster["last_verify"]
    assert set(verify["nodes"]) == set(compute) and all(v for v in verify["nodes"].values())
    assert "gres/gpu=3" in verify["alloc_tres"], verify  # one GPU on each of three nodes, accounted
    sacct = sh(
        built,
        run.controller,
        "sacct",
        "-X",
        "-n",
        "-P",
        "-j",
        verify["job_id"],
        "-o",
        "JobName,AllocTRES,State",
    )
    assert "gres/gpu=3" in sacct and "COMPLETED" in sacct, sacct
    assert {m["name"]: m["wlm_state"] for m in cluster["members"]} == {n: "idle" for n in compute}

    # drain through bcm: Slurm shows the bcm: reason, bcm shows the state
    # the deploy put its nodes in service
    assert {
        n["name"]: n["provision_state"] for n in run.cli("node", "list", "--json") if n["name"] in compute
    } == {n: "ready" for n in compute}
    drained = run.cli_raw("node", "drain", compute[1], "--reason", "fan replacement", "--json")
    assert drained.returncode == 0, drained.stdout + drained.stderr
    assert json.loads(drained.stdout)["nodes"][0]["state"] == "drained"
    reasons = sh(built, run.controller, "sinfo", "-R", "--noheader", "--format=%N|%E")
    assert f"{compute[1]}|bcm: fan replacement" in reasons, reasons
    listed = run.cli("node", "list", "--json")
    assert {n["name"]: n["wlm_state"] for n in listed if n["name"] in compute}[compute[1]] in (
        "drained",
        "draining",
    )
    # a job cannot use a drained node; verify is all or nothing and says so
    failed = run.wait(http.post("/api/v1/wlm/lab/verify").json()["operation_id"])
    assert failed["state"] == "failed" and all(r["status"] == "failed" for r in failed["results"].values()), (
        failed
    )
    assert http.get("/api/v1/wlm/lab").json()["last_verify_ok"] is False

    resumed = run.cli_raw("node", "resume", compute[1], "--json")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert json.loads(resumed.stdout)["nodes"][0]["state"] == "ready"
    assert http.get(f"/api/v1/nodes/{compute[1]}").json()["wlm_state"] == "idle"
    assert compute[1] not in sh(built, run.controller, "sinfo", "-R", "--noheader", "--format=%N")
    # Slurm's own changes flow back: drained by hand on the controller, one pass of the sync loop
    sh(built, run.controller, "scontrol", "update", f"NodeName={compute[2]}", "State=DRAIN", "Reason=by hand")
    sync_once(run)
    listed = {n["name"]: n["wlm_state"] for n in run.cli("node", "list", "--json")}
    assert listed[compute[2]] in ("drained", "draining") and listed[compute[0]] == "idle", listed
    sh(built, run.controller, "scontrol", "update", f"NodeName={compute[2]}", "State=RESUME")
    # a node outside any deployed cluster cannot be drained through Slurm
    r = http.post("/api/v1/wlm/actions/drain", json={"nodes": run.controller, "reason": "x"})
    assert r.status_code == 409 and run.controller in r.json()["message"], r.text

    # the CLI verify passes again, and a second deploy changes nothing
    res = run.cli_raw("wlm", "verify", "lab")
    assert res.returncode == 0, res.stdout + res.stderr
    again = run.deploy()
    assert again["state"] == "succeeded", explain(again)
    assert {n: r["changed"] for n, r in again["results"].items()} == {n: 0 for n in again["results"]}
    assert "changed=0" in again["log"]
    status = run.cli_raw("wlm", "status")
    assert status.returncode == 0 and "deployed" in status.stdout and "passed" in status.stdout, status.stdout

    # controller unreachable: the operation fails with the reason and claims nothing as deployed
    built.kill(run.controller)
    broken = run.deploy()
    assert broken["state"] == "failed" and "unreachable" in (broken["error"] or ""), explain(broken)
    assert all(r["status"] != "ok" for r in broken["results"].values()), broken["results"]
    # the CLI shows that reason where the (empty) results table would be, and exits non-zero
    shown = run.cli_raw(
        "wlm", "deploy", "slurm", "--name", "lab", "--controller", run.controller, "--nodes", run.hostlist
    )
    assert shown.returncode == 1, shown.stdout + shown.stderr
    assert (
        "error: operation" in shown.stderr and f"controller {run.controller} unreachable" in shown.stderr
    ), shown.stderr
    after = http.get("/api/v1/wlm/lab").json()
    assert after["state"] == "failed" and "unreachable" in after["last_error"]


def test_secrets_stay_out_of_the_database_and_logs(slurm_lab: SlurmLab) -> None:
    run = slurm_lab
    op = run.deploy(verify=False)
    assert op["state"] == "succeeded", explain(op)
    key = (run.server.state_dir / "wlm" / "lab" / "munge.key").read_bytes()
    assert (
        len(key) == 1024 and (run.server.state_dir / "wlm" / "lab" / "munge.key").stat().st_mode & 0o077 == 0
    )
    dbd = run.server.state_dir / "wlm" / "lab" / "slurmdbd.conf"
    assert dbd.stat().st_mode & 0o077 == 0 and f"StoragePass={run.db.password}" in dbd.read_text()
    # not in the API, the operation log, the server log or the database file
    blob = httpx.get(f"{run.server.url}/api/v1/wlm/lab", headers=run.http.headers).text + op["log"]
    assert run.db.password not in blob
    assert run.server.log is not None and run.db.password not in run.server.log.read_text()
    db_bytes = (run.server.state_dir / "bcm.db").read_bytes()
    assert run.db.password.encode() not in db_bytes and key[:32] not in db_bytes
    # the node got the same key, readable by munge only
    mode = sh(run.lab, run.controller, "stat", "-c", "%a %U", "/etc/munge/munge.key").split()
    assert mode == ["400", "munge"]


def test_accounting_db_is_created_and_dropped(lab_required: None, tmp_path: Path) -> None:
    db = accounting.AccountingDb.for_lab("bcmprobe", tmp_path)
    try:
        assert db.name in accounting.databases()
        pass_file = tmp_path / accounting.PASS_FILE
        assert pass_file.read_text().strip() == db.password and pass_file.stat().st_mode & 0o077 == 0
        accounting.sql(f"CREATE TABLE `{db.name}`.leftover (id INT);\n")  # an earlier lab's data
        again = accounting.AccountingDb.for_lab("bcmprobe", tmp_path)  # same names, new password
        assert again.name == db.name and again.password != db.password
        assert accounting.sql(f"SHOW TABLES FROM `{db.name}`;\n").split() == []  # the new lab starts empty
    finally:
        db.drop()
    assert db.name not in accounting.databases()
