"""Kubernetes on the lab through bcm, against a real control plane (etcd, kube-apiserver, controller
manager and scheduler built by scripts/k8s-tools) on the control-plane lab node, with each GPU lab node's
kubelet simulated by kwok on that node, and Kueue: nodes Ready with GPU capacity and GFD labels from
bcm's inventory; the verification Job admitted whole by Kueue; a Job beyond the quota pending with no pods
(gang admission); an injected XID 79 cordons and taints the node with bcm's reason and the scheduler stops
placing pods there; recovery lifts only bcm's taint; an admin's cordon stays; a killed node goes NotReady
and bcm shows it; a re-deploy changes nothing; an unreachable control plane fails the deploy clearly.
Everything through `bcm` (CLI and REST); checked with kubectl on the control-plane node.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from bcm.lab import fakegpu
from bcm.lab.slurm import SlurmLab

pytestmark = pytest.mark.lab

GPUS = 2
INTERVAL_S = 2.0
KUBECTL = ["/usr/local/lib/bcm-k8s/bin/kubectl", "--kubeconfig", "/etc/bcm-k8s/admin.kubeconfig"]
PRODUCT = "NVIDIA-H100-80GB-HBM3"


def until(what: str, check: Callable[[], Any], timeout_s: float = 120, every_s: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:  # bounded by timeout_s
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


def kubectl(run: SlurmLab, *args: str, stdin: str | None = None) -> str:
    argv = [*KUBECTL, *args]
    if stdin is not None:
        argv = ["sh", "-c", f"cat <<'EOF' | {' '.join(argv)}\n{stdin}\nEOF"]
    done = run.lab.run(run.controller, argv, timeout=60)
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stdout}{done.stderr}"
    return str(done.stdout)


def kjson(run: SlurmLab, *args: str) -> Any:
    return json.loads(kubectl(run, *args, "-o", "json"))


def nodes(run: SlurmLab) -> dict[str, Any]:
    return {n["metadata"]["name"]: n for n in kjson(run, "get", "nodes")["items"]}


def ready(node: Any) -> str:
    return next((c["status"] for c in node["status"].get("conditions", []) if c["type"] == "Ready"), "?")


def bcm_tainted(node: Any) -> bool:
    return any(t["key"] == "bcm.io/gpu-unhealthy" for t in node["spec"].get("taints") or [])


def deploy(run: SlurmLab, *extra: str) -> dict[str, Any]:
    done = run.cli_raw(
        "wlm",
        "deploy",
        "kubernetes",
        "--name",
        "k8s",
        "--control-plane",
        run.controller,
        "--nodes",
        run.hostlist,
        "--set",
        "gpu_quota=4",
        "--json",
        *extra,
    )
    try:
        op: dict[str, Any] = json.loads(done.stdout)
    except ValueError:
        raise AssertionError(
            f"deploy: {done.returncode} {done.stdout[-2000:]} {done.stderr[-2000:]}"
        ) from None
    assert (done.returncode == 0) == (op.get("state") == "succeeded"), (done.returncode, op.get("state"))
    return op


def gang_job(name: str, pods: int, gpus: int) -> str:
    return json.dumps(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": name,
                "namespace": "bcm-system",
                "labels": {"kueue.x-k8s.io/queue-name": "bcm"},
            },
            "spec": {
                "parallelism": pods,
                "completions": pods,
                "template": {
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [
                            {
                                "name": "t",
                                "image": "registry.invalid/train:1",
                                "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                            }
                        ],
                    }
                },
            },
        }
    )


def workload_of(run: SlurmLab, job: str) -> Any:
    items = kjson(run, "get", "workloads.kueue.x-k8s.io", "-n", "bcm-system")["items"]
    return next(
        (w for w in items if any(o["name"] == job for o in w["metadata"].get("ownerReferences", []))), None
    )


def held_job(name: str, ns: str, pods: int) -> str:
    """A Job whose pods hold one GPU each for 10 minutes (kwok's completion delay annotation)."""
    return json.dumps(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "namespace": ns, "labels": {"kueue.x-k8s.io/queue-name": ns}},
            "spec": {
                "parallelism": pods,
                "completions": pods,
                "template": {
                    "metadata": {"annotations": {"pod-complete.stage.kwok.x-k8s.io/delay": "10m"}},
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [
                            {
                                "name": "t",
                                "image": "registry.invalid/train:1",
                                "resources": {"limits": {"nvidia.com/gpu": "1"}},
                            }
                        ],
                    },
                },
            },
        }
    )


def conditions(wl: Any) -> dict[str, str]:
    return {c["type"]: c["status"] for c in (wl or {}).get("status", {}).get("conditions", [])}


def wl_in(run: SlurmLab, ns: str, job: str) -> Any:
    items = kjson(run, "get", "workloads.kueue.x-k8s.io", "-n", ns)["items"]
    return next(
        (w for w in items if any(o["name"] == job for o in w["metadata"].get("ownerReferences", []))), None
    )


def tenancy_in_kueue(run: SlurmLab) -> None:
    """Departments and projects rendered into Kueue: cohort, ClusterQueues with nominal quota and borrowing
    limit, namespaces with ResourceQuotas and LocalQueues; borrowing stops at the limit; the lender reclaims
    its GPUs by preemption; re-applying changes nothing; removing a project removes its objects."""
    for user in ("alice", "bob"):
        assert run.cli_raw("user", "add", user, "--role", "user").returncode == 0
    run.cli("dept", "add", "research", "--gpus", "6", "--fairshare", "10", "--json")
    run.cli("project", "add", "vision", "--dept", "research", "--gpus", "2", "--limit", "4", "--json")
    run.cli(
        "project",
        "add",
        "nlp",
        "--dept",
        "research",
        "--gpus",
        "4",
        "--limit",
        "4",
        "--fairshare",
        "3",
        "--json",
    )
    for project, user in (("vision", "alice"), ("nlp", "bob")):
        done = run.cli_raw("project", "members", "add", project, user)
        assert done.returncode == 0, done.stdout + done.stderr
    plan = run.cli("tenancy", "plan", "--cluster", "k8s", "--json")
    assert plan["applied"] is False and len(plan["changes"]) == 11, plan  # 1 cohort + 2 x 5 project objects
    assert kjson(run, "get", "namespaces")["items"] and "vision" not in kubectl(run, "get", "namespaces")
    applied = run.cli("tenancy", "apply", "--cluster", "k8s", "--json")
    assert applied["applied"] is True

    cq = kjson(run, "get", "clusterqueues.kueue.x-k8s.io", "vision")
    assert cq["spec"]["cohortName"] == "research"
    res = cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]
    assert (res["nominalQuota"], res["borrowingLimit"]) == ("2", "2")
    quota = kjson(run, "get", "resourcequota", "bcm-gpus", "-n", "nlp")
    assert quota["spec"]["hard"] == {"requests.nvidia.com/gpu": "4"}
    assert (
        kjson(run, "get", "localqueues.kueue.x-k8s.io", "vision", "-n", "vision")["spec"]["clusterQueue"]
        == "vision"
    )
    binding = kjson(run, "get", "rolebinding", "bcm-members", "-n", "nlp")
    assert [x["name"] for x in binding["subjects"]] == ["bob"]

    # re-applying changes nothing: an empty plan, and no object rewritten
    before = {
        k: kjson(run, *k.split())["metadata"]["resourceVersion"]
        for k in (
            "get clusterqueues.kueue.x-k8s.io vision",
            "get cohorts.kueue.x-k8s.io research",
            "get resourcequota bcm-gpus -n nlp",
            "get rolebinding bcm-members -n vision",
        )
    }
    again = run.cli("tenancy", "apply", "--cluster", "k8s", "--json")
    assert again["changes"] == [], again
    assert before == {k: kjson(run, *k.split())["metadata"]["resourceVersion"] for k in before}

    # vision borrows nlp's idle GPUs up to its limit (4) and no further
    kubectl(run, "create", "-f", "-", stdin=held_job("borrow", "vision", 4))
    until(
        "vision's 4-GPU job to be admitted",
        lambda: conditions(wl_in(run, "vision", "borrow")).get("QuotaReserved") == "True",
    )
    kubectl(run, "create", "-f", "-", stdin=held_job("over", "vision", 1))
    until(
        "Kueue to hold vision's fifth GPU back",
        lambda: conditions(wl_in(run, "vision", "over")).get("QuotaReserved") == "False",
    )

    def reserved() -> Any:
        status = kjson(run, "get", "clusterqueues.kueue.x-k8s.io", "vision").get("status", {})
        res = (status.get("flavorsReservation") or [{}])[0].get("resources") or [{}]
        return (res[0].get("total"), res[0].get("borrowed")) == ("4", "2")

    until("vision's queue to show 4 GPUs reserved, 2 of them borrowed", reserved)

    # nlp submits: Kueue reclaims its lent GPUs by preempting vision's borrowing job
    kubectl(run, "create", "-f", "-", stdin=held_job("reclaim", "nlp", 4))
    until(
        "nlp's job to be admitted",
        lambda: conditions(wl_in(run, "nlp", "reclaim")).get("QuotaReserved") == "True",
    )
    evicted = conditions(wl_in(run, "vision", "borrow"))
    assert evicted.get("QuotaReserved") != "True" and evicted.get("Evicted") == "True", evicted
    # usage is read from the ClusterQueue's status, which Kueue updates after it admits: wait for it
    until(
        "bcm to show nlp's 4 GPUs in use",
        lambda: run.cli("project", "usage", "nlp", "--json")["wlm"]["gpus_running"] == 4,
    )

    # removing a project removes its queue and namespace
    assert run.cli_raw("project", "rm", "vision").returncode == 0
    removed = run.cli("tenancy", "apply", "--cluster", "k8s", "--json")
    assert {(c["action"], c["name"]) for c in removed["changes"]} == {
        ("remove", "clusterqueue/vision"),
        ("remove", "namespace/vision"),
    }, removed
    until(
        "vision's ClusterQueue to be gone",
        lambda: "vision" not in kubectl(run, "get", "clusterqueues.kueue.x-k8s.io"),
    )


def test_kubernetes_lab_end_to_end(lab_required: None, tmp_path: Path) -> None:
    with SlurmLab.running(
        tmp_path, nodes=4, gpus_per_node=GPUS, name="bcmk8s", subnet="198.18.95.0/24", server_host="0.0.0.0"
    ) as run:
        http: httpx.Client = run.http
        sick, admins, dies = run.compute  # node02, node03, node04

        # a deploy to a node bcm has not inventoried is refused before anything runs
        http.post("/api/v1/nodes", json={"name": "ghost01"}).raise_for_status()
        refused = http.post(
            "/api/v1/wlm/kubernetes/deploy",
            json={"name": "k8s", "controller": run.controller, "nodes": "ghost01"},
        )
        assert refused.status_code == 409 and "not inventoried" in refused.text, refused.text

        op = deploy(run)
        assert op["state"] == "succeeded", op.get("error") or op.get("log")
        assert "verify: passed" in op["log"], op["log"]
        cluster = http.get("/api/v1/wlm/k8s").json()
        assert cluster["kind"] == "kubernetes" and cluster["last_verify_ok"] is True
        assert set(cluster["last_verify"]["nodes"]) == set(run.compute)

        # the API's truth: every GPU node Ready, with capacity and GFD labels from bcm's inventory
        seen = nodes(run)
        assert set(seen) == set(run.compute)
        for name in run.compute:
            inv = http.get(f"/api/v1/nodes/{name}/hardware").json()["gpus"]
            n = seen[name]
            assert ready(n) == "True", n["status"]
            assert n["status"]["capacity"]["nvidia.com/gpu"] == str(len(inv)) == str(GPUS)
            labels = n["metadata"]["labels"]
            assert labels["nvidia.com/gpu.product"] == inv[0]["name"].replace(" ", "-") == PRODUCT
            assert labels["nvidia.com/gpu.count"] == str(len(inv))
            assert labels["nvidia.com/gpu.memory"] == str(inv[0]["memory_mib"])
        flavors = kjson(run, "get", "resourceflavors.kueue.x-k8s.io")["items"]
        assert [f["spec"]["nodeLabels"] for f in flavors] == [{"nvidia.com/gpu.product": PRODUCT}]

        # gang admission: 3 pods x 2 GPUs = 6 > the quota of 4 -> pending, and not one pod made
        kubectl(run, "create", "-f", "-", stdin=gang_job("too-big", 3, 2))
        wl = until(
            "Kueue to consider the big job",
            lambda: (
                (w := workload_of(run, "too-big"))
                and any(
                    c["type"] == "QuotaReserved" and c["status"] == "False"
                    for c in w.get("status", {}).get("conditions", [])
                )
                and w
            ),
        )
        assert "nvidia.com/gpu" in json.dumps(wl["status"]["conditions"])
        assert kjson(run, "get", "job", "too-big", "-n", "bcm-system")["spec"]["suspend"] is True
        assert kjson(run, "get", "pods", "-n", "bcm-system", "-l", "job-name=too-big")["items"] == []
        kubectl(run, "delete", "job", "too-big", "-n", "bcm-system", "--wait=false")

        # agents on the GPU nodes, reporting from their simulated GPUs
        url = f"http://{run.lab.head_ip}:{run.server.port}"
        done = run.cli_raw(
            "agent", "deploy", f"{sick},{admins}", "--server-url", url, "--interval", str(INTERVAL_S)
        )
        assert done.returncode == 0, done.stdout + done.stderr

        # an admin cordons node03 by hand; then XID 79 on both
        kubectl(run, "cordon", admins)
        for name in (sick, admins):
            done = run.cli_raw("lab", "inject", name, "xid", "79", "--name", "bcmk8s", "--timeout", "120")
            assert done.returncode == 0, done.stdout + done.stderr
        n = until("bcm's taint on the sick node", lambda: bcm_tainted(m := nodes(run)[sick]) and m)
        assert n["spec"]["unschedulable"] is True
        reason = n["metadata"]["annotations"]["bcm.io/drain-reason"]
        assert reason.startswith(f"bcm: GPU 0 {fakegpu.gpu_uuid(sick, 0)}") and "lost" in reason, reason
        until(
            "bcm to leave the admin's cordon alone",
            lambda: any(
                "left alone" in e["message"]
                for e in http.get("/api/v1/health/events", params={"node": admins}).json()
            ),
        )
        assert not bcm_tainted(nodes(run)[admins])

        # the scheduler places nothing on the sick node any more
        pod = json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "pinned", "namespace": "default"},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": sick},
                    "containers": [{"name": "c", "image": "registry.invalid/x:1"}],
                },
            }
        )
        kubectl(run, "create", "-f", "-", stdin=pod)
        cond = until(
            "the scheduler to refuse the pinned pod",
            lambda: next(
                (
                    c
                    for c in kjson(run, "get", "pod", "pinned", "-n", "default")["status"].get(
                        "conditions", []
                    )
                    if c["type"] == "PodScheduled" and c["status"] == "False"
                ),
                None,
            ),
        )
        assert "bcm.io/gpu-unhealthy" in cond["message"] or "unschedulable" in cond["message"], cond
        assert not kjson(run, "get", "pod", "pinned", "-n", "default")["spec"].get("nodeName")

        # recovery: bcm lifts its own cordon and taint; the admin's cordon stays
        for name in (sick, admins):
            done = run.cli_raw("lab", "inject", name, "recover", "--name", "bcmk8s", "--timeout", "180")
            assert done.returncode == 0, done.stdout + done.stderr
        n = until("bcm to lift its taint", lambda: not bcm_tainted(m := nodes(run)[sick]) and m)
        assert not n["spec"].get("unschedulable")
        assert nodes(run)[admins]["spec"]["unschedulable"] is True
        until(
            "the pinned pod to be placed",
            lambda: kjson(run, "get", "pod", "pinned", "-n", "default")["spec"].get("nodeName") == sick,
        )

        # a re-deploy changes nothing: Ansible changed=0 and no API object rewritten
        versions = {
            k: v["metadata"]["resourceVersion"]
            for k, v in (
                ("cq", kjson(run, "get", "clusterqueues.kueue.x-k8s.io", "bcm-gpus")),
                ("lq", kjson(run, "get", "localqueues.kueue.x-k8s.io", "bcm", "-n", "bcm-system")),
                ("rbac", kjson(run, "get", "clusterrole", "bcm:kwok")),
                ("hook", kjson(run, "get", "validatingwebhookconfiguration", "bcm-kueue-validating")),
            )
        }
        again = deploy(run, "--no-verify")
        assert again["state"] == "succeeded", again.get("error")
        assert "changed=0\n" in again["log"] and "api: changed=0" in again["log"], again["log"]
        assert all(r["changed"] == 0 for r in again["results"].values()), again["results"]
        assert versions == {
            k: v["metadata"]["resourceVersion"]
            for k, v in (
                ("cq", kjson(run, "get", "clusterqueues.kueue.x-k8s.io", "bcm-gpus")),
                ("lq", kjson(run, "get", "localqueues.kueue.x-k8s.io", "bcm", "-n", "bcm-system")),
                ("rbac", kjson(run, "get", "clusterrole", "bcm:kwok")),
                ("hook", kjson(run, "get", "validatingwebhookconfiguration", "bcm-kueue-validating")),
            )
        }

        kubectl(run, "uncordon", admins)  # the admin is done: all 6 GPUs schedulable for what follows
        tenancy_in_kueue(run)

        # a killed lab node goes NotReady in the API, and bcm shows it
        run.lab.kill(dies)
        until("the killed node to go NotReady", lambda: ready(nodes(run)[dies]) != "True", timeout_s=180)
        shown = until(
            "bcm to show it",
            lambda: (
                (s := run.cli("wlm", "status", "k8s", "--sync", "--json"))
                and next(m for m in s["members"] if m["name"] == dies)["wlm_state"].startswith(
                    ("notready", "unknown")
                )
                and s
            ),
        )
        assert shown["kind"] == "kubernetes"
        node = run.cli("node", "show", dies, "--json")
        assert node["wlm_state"].startswith(("notready", "unknown")), node

        # an unreachable control plane fails the deploy with a clear error
        run.lab.kill(run.controller)
        failed = deploy(run, "--no-verify")
        assert failed["state"] == "failed"
        assert f"controller {run.controller} unreachable" in (failed.get("error") or ""), failed
