"""Tenancy rendered into a real Slurm with slurmdbd: departments and projects become accounts, members
user associations; GrpTRES holds a project at its limit; hand edits show as drift; deleting a project
removes its associations; applying twice changes nothing; fair-share weights order a shared backlog.
Everything through `bcm` (CLI and REST), checked with Slurm's own tools on the controller.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bcm.lab.slurm import SlurmLab

pytestmark = pytest.mark.lab

WAIT_S = 90  # every wait below polls Slurm until its state shows, at most this long


@pytest.fixture
def ten_lab(lab_required: None, tmp_path: Path) -> Iterator[SlurmLab]:
    with SlurmLab.running(tmp_path, nodes=3, gpus_per_node=2, name="bcmten", subnet="198.18.90.0/24") as run:
        yield run


def sh(run: SlurmLab, *argv: str) -> str:
    done = run.lab.run(run.controller, list(argv), timeout=60)
    assert done.returncode == 0, f"{argv}: {done.stdout}{done.stderr}"
    return str(done.stdout)


def bcm(run: SlurmLab, *args: str) -> Any:
    return run.cli(*args, "--json")


def tree(run: SlurmLab) -> dict[tuple[str, str], tuple[str, str, str]]:
    """(account, user) -> (parent, fairshare, GrpTRES) from `sacctmgr show assoc tree`, bcm's accounts only."""
    out = sh(
        run,
        "sacctmgr",
        "-nP",
        "show",
        "assoc",
        "tree",
        "where",
        "cluster=lab",
        "format=Account,User,ParentName,Fairshare,GrpTRES",
    )
    rows: dict[tuple[str, str], tuple[str, str, str]] = {}
    for line in out.splitlines():
        account, user, parent, share, tres = (p.strip() for p in line.split("|")[:5])
        if account != "root":
            rows[(account, user)] = (parent, share, tres)
    return rows


def as_user(run: SlurmLab, user: str, command: str) -> str:
    return sh(run, "sh", "-c", f"cd /tmp && runuser -u {user} -- {command}")


def submit(
    run: SlurmLab, user: str, account: str, seconds: int = 600, name: str = "t", extra: str = "--gres=gpu:1"
) -> str:
    out = as_user(
        run,
        user,
        f"sbatch --parsable --account={account} {extra} --mem=64M --job-name={name} -o /dev/null --wrap='sleep {seconds}'",
    )
    return out.strip().split(";")[0]


def wait_for(what: str, check: Any) -> Any:
    deadline = time.monotonic() + WAIT_S
    while True:  # bounded by WAIT_S
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not seen within {WAIT_S}s"
        time.sleep(1)


def job_state(run: SlurmLab, job: str) -> tuple[str, str]:
    out = sh(run, "squeue", "-h", "-j", job, "-o", "%T|%r").strip()
    state, _, reason = out.partition("|")
    return state, reason


def test_tenancy_in_slurm_accounting(ten_lab: SlurmLab) -> None:
    run = ten_lab
    for user in ("alice", "bob", "carol"):
        run.cli_raw("user", "add", user, "--role", "user")
    bcm(run, "dept", "add", "research", "--gpus", "4", "--fairshare", "10")
    bcm(run, "dept", "add", "ops", "--gpus", "2", "--fairshare", "5")
    bcm(
        run,
        "project",
        "add",
        "vision",
        "--dept",
        "research",
        "--gpus",
        "1",
        "--limit",
        "1",
        "--fairshare",
        "1",
    )
    bcm(run, "project", "add", "nlp", "--dept", "research", "--gpus", "2", "--limit", "3", "--fairshare", "9")
    bcm(run, "project", "add", "infra", "--dept", "ops", "--gpus", "1", "--limit", "2")
    for project, user in (("vision", "alice"), ("nlp", "bob"), ("infra", "carol"), ("nlp", "alice")):
        done = run.cli_raw("project", "members", "add", project, user)
        assert done.returncode == 0, done.stdout + done.stderr

    # the deploy renders enforcement, since departments exist
    op = run.deploy(verify=False)
    assert op["state"] == "succeeded", op.get("error")
    config = sh(run, "scontrol", "show", "config")
    assert any(
        line.split("=", 1)[0].strip() == "AccountingStorageEnforce" and "limits" in line
        for line in config.splitlines()
    ), config

    # plan: a diff, nothing changed yet
    plan = bcm(run, "tenancy", "plan")
    assert plan["applied"] is False, plan
    assert plan["drift"] == 0, ([c for c in plan["changes"] if c["drift"]], tree(run))  # Slurm starts empty
    added = {(c["kind"], c["name"]) for c in plan["changes"] if c["action"] == "add"}
    assert {("account", a) for a in ("research", "ops", "vision", "nlp", "infra")} <= added, plan
    assert {("user", u) for u in ("alice", "bob", "carol")} <= added, plan
    assert tree(run) == {}

    # apply: the tree matches the model
    applied = bcm(run, "tenancy", "apply")
    assert applied["applied"] is True and len(applied["changes"]) == len(plan["changes"]), applied
    want = {
        ("research", ""): ("root", "10", ""),
        ("ops", ""): ("root", "5", ""),
        ("vision", ""): ("research", "1", "gres/gpu=1"),
        ("vision", "alice"): ("", "1", ""),
        ("nlp", ""): ("research", "9", "gres/gpu=3"),
        ("nlp", "alice"): ("", "1", ""),
        ("nlp", "bob"): ("", "1", ""),
        ("infra", ""): ("ops", "1", "gres/gpu=2"),
        ("infra", "carol"): ("", "1", ""),
    }
    got = tree(run)
    assert {k: (v[0] if not k[1] else "", v[1], v[2]) for k, v in got.items()} == want, got
    # re-apply changes nothing
    again = bcm(run, "tenancy", "apply")
    assert again["changes"] == [], again
    # the members exist as Unix users with the same uid on every node
    uids = {n: run.lab.run(n, ["id", "-u", "alice"]).stdout.strip() for n in [run.controller, *run.compute]}
    assert len(set(uids.values())) == 1 and next(iter(uids.values())).isdigit(), uids

    # GrpTRES: vision may hold one GPU; a second job stays pending with AssocGrpGRES
    first = submit(run, "alice", "vision")
    wait_for("first vision job running", lambda: job_state(run, first)[0] == "RUNNING")
    second = submit(run, "alice", "vision")
    wait_for(
        "second vision job pending on AssocGrpGRES",
        lambda: job_state(run, second) == ("PENDING", "AssocGrpGRES"),
    )
    # GPUs are idle (the cluster has four), yet it waits: the limit, not the room
    usage = bcm(run, "project", "usage", "vision")
    assert usage["wlm"]["gpus_running"] == 1 and usage["wlm"]["gpus_pending"] == 1, usage
    # the sync samples who runs where (squeue): the node running it names vision, with its one GPU
    assert run.http.post("/api/v1/wlm/lab/sync").status_code == 200
    node = sh(run, "squeue", "-h", "-j", first, "-o", "%N").strip()
    tenants = run.http.get(f"/api/v1/nodes/{node}").json()["tenants"]
    assert {"account": "vision", "gpus": 1, "jobs": 1} in tenants, (node, tenants)
    # a member reads their own project's usage and nothing else
    token = run.http.post("/api/v1/tokens", json={"name": "alice-t", "role": "user", "user": "alice"}).json()
    as_alice = {"Authorization": f"Bearer {token['token']}"}
    assert run.http.get("/api/v1/projects/vision/usage", headers=as_alice).status_code == 200
    assert run.http.get("/api/v1/projects/infra/usage", headers=as_alice).status_code == 403
    assert run.http.get("/api/v1/tenancy/plan", headers=as_alice).status_code == 403
    sh(run, "scancel", "-u", "alice")
    wait_for("alice's jobs gone", lambda: sh(run, "squeue", "-h", "-u", "alice").strip() == "")

    # a hand edit in sacctmgr shows as drift; apply puts the model back
    sh(run, "sacctmgr", "-i", "modify", "account", "where", "name=nlp", "cluster=lab", "set", "fairshare=5")
    drift = bcm(run, "tenancy", "plan")
    assert [(c["action"], c["name"], c["drift"]) for c in drift["changes"]] == [("modify", "nlp", True)], (
        drift
    )
    assert "5 -> 9" in drift["changes"][0]["detail"]
    bcm(run, "tenancy", "apply")
    assert tree(run)[("nlp", "")][1] == "9"
    # a model change is not drift
    bcm(run, "project", "set", "nlp", "--limit", "4")
    changed = bcm(run, "tenancy", "plan")
    assert [(c["name"], c["drift"]) for c in changed["changes"]] == [("nlp", False)], changed
    bcm(run, "tenancy", "apply")
    assert tree(run)[("nlp", "")][2] == "gres/gpu=4"

    # deleting a project removes its associations (alice keeps nlp, her default account moves)
    run.cli_raw("project", "rm", "vision")
    gone = bcm(run, "tenancy", "apply")
    assert {(c["action"], c["kind"], c["name"]) for c in gone["changes"]} >= {
        ("remove", "account", "vision"),
        ("remove", "user", "alice"),
    }, gone
    after = tree(run)
    assert not [k for k in after if k[0] == "vision"], after
    assert ("nlp", "alice") in after
    assert (
        sh(run, "sacctmgr", "-nP", "show", "assoc", "where", "account=vision", "format=account,user").strip()
        == ""
    )
    # and the department with its last project
    run.cli_raw("project", "rm", "infra")
    run.cli_raw("dept", "rm", "ops")
    bcm(run, "tenancy", "apply")
    assert not [k for k in tree(run) if k[0] in ("ops", "infra")]
    final = bcm(run, "tenancy", "apply")
    assert final["changes"] == [], final


def sacct_rows(run: SlurmLab, jobs: list[str]) -> list[tuple[str, str, str, str]]:
    """(job, account, state, start) per job, from accounting."""
    out = sh(run, "sacct", "-X", "-n", "-P", "-j", ",".join(jobs), "-o", "JobID,Account,State,Start")
    return [tuple(line.split("|")[:4]) for line in out.splitlines() if line.strip()]  # type: ignore[misc]


def finished(run: SlurmLab, jobs: list[str]) -> bool:
    rows = sacct_rows(run, jobs)
    return len(rows) == len(jobs) and all(r[2] == "COMPLETED" for r in rows)


def test_fair_share_orders_a_shared_backlog(ten_lab: SlurmLab) -> None:
    """Same usage so far, same backlog: the project with nine times the shares gets the GPUs first."""
    run = ten_lab
    for user in ("alice", "bob"):
        run.cli_raw("user", "add", user, "--role", "user")
    bcm(run, "dept", "add", "shared", "--gpus", "4")
    bcm(run, "project", "add", "light", "--dept", "shared", "--gpus", "2", "--limit", "4", "--fairshare", "1")
    bcm(run, "project", "add", "heavy", "--dept", "shared", "--gpus", "2", "--limit", "4", "--fairshare", "9")
    for project, user in (("light", "alice"), ("heavy", "bob")):
        assert run.cli_raw("project", "members", "add", project, user).returncode == 0
    deployed = run.cli_raw(
        "wlm",
        "deploy",
        "slurm",
        "--name",
        "lab",
        "--controller",
        run.controller,
        "--nodes",
        run.hostlist,
        "--no-verify",
        "--json",
        "--set",
        "priority_calc_period=1",
    )
    assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-2000:]
    bcm(run, "tenancy", "apply")
    assert "PriorityCalcPeriod" in sh(run, "scontrol", "show", "config")

    # the same usage first: one identical job each, side by side
    warm = [
        submit(run, "alice", "light", seconds=20, name="warm", extra="-N1 --gres=gpu:2"),
        submit(run, "bob", "heavy", seconds=20, name="warm", extra="-N1 --gres=gpu:2"),
    ]
    wait_for("warm-up jobs done", lambda: finished(run, warm))

    def usage(account: str) -> int:
        out = sh(run, "sshare", "-nP", "-A", account, "-o", "Account,User,RawUsage")
        return sum(
            int(p[2]) for p in (ln.split("|") for ln in out.splitlines()) if not p[1] and p[2].isdigit()
        )

    wait_for("usage recorded for both", lambda: usage("light") > 0 and usage("heavy") > 0)

    # a job of root's holds every GPU while the backlog queues behind it, light's submitted first
    blocker = (
        sh(
            run,
            "sh",
            "-c",
            "cd /tmp && sbatch --parsable -N2 --gres=gpu:2 --mem=64M -o /dev/null --wrap='sleep 600'",
        )
        .strip()
        .split(";")[0]
    )
    wait_for("blocker running", lambda: job_state(run, blocker)[0] == "RUNNING")
    backlog = []
    for i in range(2):
        backlog.append(submit(run, "alice", "light", seconds=3, name=f"light{i}", extra="-N2 --gres=gpu:2"))
        backlog.append(submit(run, "bob", "heavy", seconds=3, name=f"heavy{i}", extra="-N2 --gres=gpu:2"))

    def fairshare_factors() -> dict[str, float]:
        out = sh(run, "sprio", "-h", "-j", ",".join(backlog), "-o", "%i|%f")
        return {p[0].strip(): float(p[1]) for p in (ln.split("|") for ln in out.splitlines()) if len(p) == 2}

    def heavy_ahead() -> bool:
        f = fairshare_factors()
        if len(f) != len(backlog):
            return False
        return min(f[j] for j in backlog[1::2]) > max(f[j] for j in backlog[0::2])

    wait_for("fair-share factors that tell the projects apart", heavy_ahead)
    sh(run, "scancel", blocker)
    wait_for("backlog done", lambda: finished(run, backlog))
    rows = sorted(sacct_rows(run, backlog), key=lambda r: (r[3], int(r[0])))
    assert [r[1] for r in rows] == ["heavy", "heavy", "light", "light"], rows
