"""The tenants' sample over HTTP: stored as the workload-manager sync stores it (squeue's output parsed,
then ``wlm_usage.apply``), it shows in node JSON, in the Nodes page's tenant column (escaped) and as the
Tenancy page's in-use meters against quota, deserved GPUs and limit; a later sample replaces it."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from fastapi.testclient import TestClient
from sqlmodel import Session, select

from bcm.drivers.wlm import slurm_usage
from bcm.drivers.wlm.base import NodeUsage
from bcm.models.node import Node
from bcm.models.wlm import WlmCluster, WlmMember
from bcm.services import wlm_usage
from bcm.workers import wlm as wlm_worker

# as `squeue -h -r -t R -O JobID:0|,Account:0|,…` prints it on a cluster that accounts GPUs (slurmdbd)
SQUEUE = (
    "41|nlp|gpu[01-02]|cpu=16,mem=64G,node=2,billing=16,gres/gpu=3|N/A|gres:gpu:3\n"
    "42|vision|gpu02|cpu=2,mem=8G,node=1,billing=2,gres/gpu=2|gres:gpu:2|N/A\n"
    "43|<img src=x onerror=alert(1)>|gpu03|cpu=1,node=1,billing=1|N/A|N/A\n"
)


def _ok(r: Any, code: int = 200) -> Any:
    assert r.status_code == code, r.text
    return r.json()


def _cluster(engine: Any) -> None:
    """Database before: a deployed Slurm cluster `lab`, controller `head`, members gpu[01-03]."""
    with Session(engine) as s:
        ids = {n.name: n.id for n in s.exec(select(Node))}
        row = WlmCluster(name="lab", kind="slurm", controller_id=ids["head"], state="deployed")
        s.add(row)
        s.flush()
        s.add(WlmMember(cluster_id=row.id, node_id=ids["head"], role="controller"))
        for n in ("gpu01", "gpu02", "gpu03"):
            s.add(WlmMember(cluster_id=row.id, node_id=ids[n], role="compute"))
        s.commit()


def _sample(engine: Any, squeue: str) -> None:
    with Session(engine) as s:
        wlm_usage.apply(s, "lab", slurm_usage.parse_running(squeue))
        s.commit()


def _signed_in(api: Any) -> TestClient:
    token = _ok(api.post("/api/v1/tokens", json={"name": "ui-viewer", "role": "viewer"}), 201)["token"]
    ui = TestClient(api.app)
    form = ui.get("/ui/signin").text
    csrf = re.search(r'name="csrf" value="([^"]+)"', form).group(1)  # type: ignore[union-attr]
    r = ui.post("/ui/signin", data={"csrf": csrf, "token": token})
    assert r.status_code == 200 and r.url.path == "/ui/", (r.status_code, r.url)
    return ui


def _row(html: str, attr: str, name: str) -> str:
    m = re.search(rf'<tr {attr}="{re.escape(name)}">(.*?)</tr>', html, re.S)
    assert m, f"no row {attr}={name}"
    return m.group(1)


def _tenant_cell(html: str, node: str) -> str:
    m = re.search(r'<td class="tenants">(.*?)</td>', _row(html, "data-node", node), re.S)
    assert m
    return " ".join(re.sub(r"<[^>]+>", " ", m.group(1)).split())


def _meter(html: str, attr: str, name: str) -> dict[str, str]:
    m = re.search(r"<meter ([^>]*)>(.*?)</meter>", _row(html, attr, name), re.S)
    assert m, f"no meter for {name}"
    return dict(re.findall(r'(\w[\w-]*)="([^"]*)"', m.group(1))) | {"text": m.group(2)}


def test_sampled_tenants_show_on_nodes_and_as_tenancy_meters(api: Any, engine: Any) -> None:
    _ok(api.post("/api/v1/nodes/bulk", json={"nodes": "gpu[01-04],head"}), 201)
    _cluster(engine)
    _ok(api.post("/api/v1/departments", json={"name": "research", "gpu_quota": 8}), 201)
    _ok(
        api.post(
            "/api/v1/projects",
            json={"name": "nlp", "department": "research", "deserved_gpus": 2, "limit_gpus": 4},
        ),
        201,
    )
    _ok(
        api.post("/api/v1/projects", json={"name": "vision", "department": "research", "deserved_gpus": 1}),
        201,
    )
    _sample(engine, SQUEUE)

    # node JSON: most GPUs first
    gpu02 = _ok(api.get("/api/v1/nodes/gpu02"))
    assert gpu02["tenants"] == [
        {"account": "vision", "gpus": 2, "jobs": 1},
        {"account": "nlp", "gpus": 1, "jobs": 1},
    ]
    assert _ok(api.get("/api/v1/nodes/gpu04"))["tenants"] == []
    assert _ok(api.get("/api/v1/wlm/lab"))["usage_at"] is not None

    ui = _signed_in(api)
    nodes = ui.get("/ui/nodes").text
    assert '<th scope="col"' in nodes and ">Tenant</th>" in nodes
    assert _tenant_cell(nodes, "gpu01") == "nlp 2 GPUs"
    assert _tenant_cell(nodes, "gpu02") == "vision 2 GPUs , nlp 1 GPU"
    assert _tenant_cell(nodes, "gpu04") == "–"
    # an account as the workload manager names it is text, never markup
    assert "<img src=x" not in nodes
    assert _tenant_cell(nodes, "gpu03") == "&lt;img src=x onerror=alert(1)&gt; 0 GPUs"
    assert "vision" in ui.get("/ui/nodes/gpu02").text

    tenancy = ui.get("/ui/tenancy").text
    assert ' style="' not in tenancy and "<style" not in tenancy  # the CSP has no unsafe-inline
    nlp = _meter(tenancy, "data-project", "nlp")
    assert (nlp["value"], nlp["max"], nlp["low"], nlp["high"]) == ("3", "4", "2", "4")
    assert nlp["text"] == "3 of 4 GPUs" and nlp["aria-label"] == "nlp: 3 of 4 GPUs in use (deserves 2)"
    vision = _meter(
        tenancy, "data-project", "vision"
    )  # over its limit of 1: the bar is full, the text says so
    assert (vision["value"], vision["max"], vision["high"]) == ("2", "2", "1")
    assert 'class="use-text over" aria-hidden="true">2 of 1 GPUs' in _row(tenancy, "data-project", "vision")
    research = _meter(tenancy, "data-department", "research")
    assert (research["value"], research["max"], research["text"]) == ("5", "8", "5 of 8 GPUs")
    assert "lab 20" in tenancy  # when the sample was taken

    # a later sample replaces this one: nlp grew on gpu01, gpu02 and gpu03 are free
    _sample(engine, "44|nlp|gpu01|cpu=8,node=1,billing=8,gres/gpu=4|N/A|N/A\n")
    assert _ok(api.get("/api/v1/nodes/gpu01"))["tenants"] == [{"account": "nlp", "gpus": 4, "jobs": 1}]
    assert _ok(api.get("/api/v1/nodes/gpu02"))["tenants"] == []
    assert _meter(ui.get("/ui/tenancy").text, "data-project", "nlp")["value"] == "4"

    # the next sync finds nothing running
    _sample(engine, "")
    assert _ok(api.get("/api/v1/nodes/gpu02"))["tenants"] == []
    assert _tenant_cell(ui.get("/ui/nodes").text, "gpu02") == "–"
    assert _meter(ui.get("/ui/tenancy").text, "data-project", "nlp")["value"] == "0"


def test_a_node_leaving_the_inventory_or_its_cluster_takes_its_sample_with_it(api: Any, engine: Any) -> None:
    _ok(api.post("/api/v1/nodes/bulk", json={"nodes": "gpu[01-03],head"}), 201)
    _cluster(engine)
    _sample(engine, SQUEUE)
    with Session(engine) as s:
        gone = s.exec(select(Node).where(Node.name == "gpu01")).one()
        s.delete(gone)
        s.commit()
    with Session(engine) as s:
        assert sorted(wlm_usage.account_gpus(s).items()) == [
            ("<img src=x onerror=alert(1)>", 0),
            ("nlp", 1),
            ("vision", 2),
        ]
    # gpu03 moves to a Kubernetes cluster, whose first sample sees a project's pod there: lab's row for it goes
    with Session(engine) as s:
        gpu03 = s.exec(select(Node).where(Node.name == "gpu03")).one()
        k8s = WlmCluster(name="k8s", kind="kubernetes", controller_id=gpu03.id or 0, state="deployed")
        s.add(k8s)
        s.flush()
        member = s.exec(select(WlmMember).where(WlmMember.node_id == gpu03.id)).one()
        member.cluster_id = k8s.id or 0
        s.add(member)
        s.commit()
    with Session(engine) as s:
        wlm_usage.apply(s, "k8s", [NodeUsage("gpu03", "vision", 1, 1)])
        s.commit()
    with Session(engine) as s:
        assert sorted(wlm_usage.account_gpus(s).items()) == [("nlp", 1), ("vision", 3)]


def test_a_cluster_the_sync_no_longer_reads_keeps_no_sample(api: Any, engine: Any, settings: Any) -> None:
    """A failed redeploy: the sync's pass reads no workload manager for the cluster any more and drops its
    sample, which would only grow stale. (The controller `head` has no address: no pass reaches the network.)"""
    _ok(api.post("/api/v1/nodes/bulk", json={"nodes": "gpu[01-03],head"}), 201)
    _cluster(engine)
    _sample(engine, SQUEUE)
    asyncio.run(
        wlm_worker.sync_all(engine, settings)
    )  # deployed, its read fails (no address): the sample stays
    with Session(engine) as s:
        assert wlm_usage.account_gpus(s)["nlp"] == 3
        lab = s.exec(select(WlmCluster)).one()
        lab.state = "failed"
        s.add(lab)
        s.commit()
    asyncio.run(wlm_worker.sync_all(engine, settings))
    assert _ok(api.get("/api/v1/nodes/gpu01"))["tenants"] == []
    with Session(engine) as s:
        assert wlm_usage.account_gpus(s) == {} and wlm_usage.sampled(s) == [("lab", None)]
