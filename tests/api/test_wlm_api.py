"""/api/v1/wlm without a lab: bad input is refused before anything runs (404, 409, 422)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import update
from sqlmodel import Session, select

from bcm.models.base import utcnow
from bcm.models.node import Node

FACTS = {"cpu": {"sockets": 1, "cores": 4, "threads": 8}, "memory_bytes": 16 << 30}
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"


@pytest.fixture
def wlm_api(api: Any) -> Any:
    """The API (the WLM routes are part of it)."""
    return api


def inventoried(engine: Any, *names: str) -> None:
    with Session(engine) as s:
        s.execute(
            update(Node)
            .where(Node.name.in_(names))  # type: ignore[attr-defined]
            .values(provision_state="inventoried", facts=FACTS, inventoried_at=utcnow(), ssh_host_key=KEY)
        )
        s.commit()


def body(**kw: Any) -> dict[str, Any]:
    return {"controller": "head", "nodes": "gpu[01-03]", **kw}


def test_unknown_nodes_are_404(wlm_api: Any) -> None:
    r = wlm_api.post("/api/v1/wlm/slurm/deploy", json=body())
    assert r.status_code == 404 and "gpu[01-03]" in r.json()["message"]


def test_nodes_not_inventoried_are_409_naming_them(wlm_api: Any, engine: Any) -> None:
    assert (
        wlm_api.post("/api/v1/nodes/bulk", json={"nodes": "gpu[01-03],head", "ip": "198.18.9.10"}).status_code
        == 201
    )
    inventoried(engine, "head", "gpu01")
    r = wlm_api.post("/api/v1/wlm/slurm/deploy", json=body())
    assert r.status_code == 409, r.text
    assert "gpu[02-03]" in r.json()["message"] and "not inventoried" in r.json()["message"]
    assert wlm_api.get("/api/v1/wlm").json() == []  # nothing recorded
    with Session(engine) as s:  # and nothing locked
        assert all(n.lock_owner is None for n in s.exec(select(Node)))


def test_controller_not_inventoried_is_409(wlm_api: Any, engine: Any) -> None:
    assert (
        wlm_api.post("/api/v1/nodes/bulk", json={"nodes": "gpu[01-03],head", "ip": "198.18.9.10"}).status_code
        == 201
    )
    inventoried(engine, "gpu01", "gpu02", "gpu03")
    r = wlm_api.post("/api/v1/wlm/slurm/deploy", json=body())
    assert r.status_code == 409 and "controller" in r.json()["message"] and "head" in r.json()["message"]


@pytest.mark.parametrize(
    "bad",
    [
        {"name": "Bad-Name"},
        {"controller": "-x"},
        {"nodes": "gpu[01-"},
        {"settings": {"gpu_device_dir": "dev"}},
        {"settings": {"slurmd_parameters": "a\nSlurmUser=root"}},
        {"settings": {"no_such_setting": 1}},
        {"storage_pass": "two\nlines"},
    ],
)
def test_malformed_requests_are_422(wlm_api: Any, bad: dict[str, Any]) -> None:
    r = wlm_api.post("/api/v1/wlm/slurm/deploy", json=body(**bad))
    assert r.status_code == 422, r.text


@pytest.mark.parametrize(
    "bad",
    [
        {"name": "Bad_Name"},
        {"settings": {"mode": "kind"}},
        {"settings": {"version": "1.36"}},
        {"settings": {"pod_subnet": "10.0.0.0/30"}},
        {"settings": {"service_subnet": "10.96.0.0/12", "mode": "lab"}},
        {"settings": {"tools_dir": "/opt/../etc"}},
        {"settings": {"gpu_quota": -1}},
        {"settings": {"api_port": 70000}},
        {"settings": {"verify_image": "a b"}},
        {"settings": {"no_such_setting": 1}},
    ],
)
def test_malformed_kubernetes_requests_are_422_naming_the_field(wlm_api: Any, bad: dict[str, Any]) -> None:
    r = wlm_api.post("/api/v1/wlm/kubernetes/deploy", json=body(**bad))
    assert r.status_code == 422, r.text
    assert next(iter(bad)) in r.text
    key = next(iter(bad["settings"])) if "settings" in bad else None
    assert key is None or key in r.text


def test_kubernetes_deploy_to_nodes_not_inventoried_is_409(wlm_api: Any, engine: Any) -> None:
    assert (
        wlm_api.post("/api/v1/nodes/bulk", json={"nodes": "gpu[01-03],head", "ip": "198.18.9.10"}).status_code
        == 201
    )
    inventoried(engine, "head", "gpu01")
    r = wlm_api.post("/api/v1/wlm/kubernetes/deploy", json=body())
    assert r.status_code == 409, r.text
    assert "gpu[02-03]" in r.json()["message"] and "not inventoried" in r.json()["message"]
    assert wlm_api.get("/api/v1/wlm").json() == []


def test_a_slurm_cluster_name_cannot_be_redeployed_as_kubernetes(wlm_api: Any, engine: Any) -> None:
    assert (
        wlm_api.post("/api/v1/nodes/bulk", json={"nodes": "gpu01,head", "ip": "198.18.9.10"}).status_code
        == 201
    )
    inventoried(engine, "head", "gpu01")
    _plan(engine, "lab", "head", "gpu01")
    inventoried(engine, "head", "gpu01")
    r = wlm_api.post("/api/v1/wlm/kubernetes/deploy", json=body(name="lab", nodes="gpu01"))
    assert r.status_code == 409 and "slurm cluster" in r.json()["message"], r.text


def test_drain_of_nodes_outside_any_cluster_is_409(wlm_api: Any) -> None:
    assert wlm_api.post("/api/v1/nodes/bulk", json={"nodes": "gpu01"}).status_code == 201
    r = wlm_api.post("/api/v1/wlm/actions/drain", json={"nodes": "gpu01", "reason": "x"})
    assert r.status_code == 409 and "gpu01" in r.json()["message"]


def test_status_of_unknown_cluster_is_404(wlm_api: Any) -> None:
    assert wlm_api.get("/api/v1/wlm/nope").status_code == 404
    assert wlm_api.post("/api/v1/wlm/nope/verify").status_code == 404


# ---- membership: rows in wlm_member, shown as a folded hostlist -------------------------------------------


def _plan(engine: Any, name: str, controller: str, nodes: str) -> None:
    from bcm.db import session_scope
    from bcm.models.wlm import SlurmDeployRequest
    from bcm.services import wlm as wlm_svc

    with session_scope(engine) as s:
        wlm_svc.plan_deploy(
            s, "slurm", SlurmDeployRequest(name=name, controller=controller, nodes=nodes), "test"
        )


def _rows(engine: Any) -> set[tuple[str, str, str]]:
    from bcm.models.wlm import WlmCluster, WlmMember

    with Session(engine) as s:
        stmt = (
            select(WlmCluster.name, Node.name, WlmMember.role)
            .join(WlmMember, WlmMember.cluster_id == WlmCluster.id)  # type: ignore[arg-type]
            .join(Node, Node.id == WlmMember.node_id)  # type: ignore[arg-type]
        )
        return set(s.exec(stmt).all())


def _deployed(engine: Any, name: str) -> None:
    from bcm.models.wlm import WlmCluster

    with Session(engine) as s:
        s.execute(update(WlmCluster).where(WlmCluster.name == name).values(state="deployed"))  # type: ignore[arg-type]
        s.commit()


def test_members_are_rows_shown_as_a_hostlist(wlm_api: Any, engine: Any) -> None:
    r = wlm_api.post("/api/v1/nodes/bulk", json={"nodes": "head,gpu[01-03],gpu10", "ip": "198.18.9.10"})
    assert r.status_code == 201, r.text
    inventoried(engine, "head", "gpu01", "gpu02", "gpu03", "gpu10")
    _plan(engine, "alpha", "head", "gpu10,gpu[01-03]")
    assert _rows(engine) == {("alpha", "head", "controller")} | {
        ("alpha", n, "compute") for n in ("gpu01", "gpu02", "gpu03", "gpu10")
    }
    listed = wlm_api.get("/api/v1/wlm").json()
    assert [(c["name"], c["controller"], c["nodes"]) for c in listed] == [("alpha", "head", "gpu[01-03,10]")]
    shown = wlm_api.get("/api/v1/wlm/alpha").json()
    assert shown["nodes"] == "gpu[01-03,10]"
    assert [m["name"] for m in shown["members"]] == ["gpu01", "gpu02", "gpu03", "gpu10"]  # hostlist order

    # a deleted node leaves its cluster
    assert wlm_api.delete("/api/v1/nodes/gpu10").status_code == 200
    assert wlm_api.get("/api/v1/wlm/alpha").json()["nodes"] == "gpu[01-03]"


def test_a_node_is_in_at_most_one_cluster(wlm_api: Any, engine: Any) -> None:
    from bcm.errors import Conflict

    r = wlm_api.post("/api/v1/nodes/bulk", json={"nodes": "head,gpu[01-04]", "ip": "198.18.9.10"})
    assert r.status_code == 201, r.text
    inventoried(engine, "head", "gpu01", "gpu02", "gpu03", "gpu04")
    _plan(engine, "alpha", "head", "gpu[01-02]")
    with pytest.raises(Conflict, match=r"nodes: gpu02 already belong to cluster 'alpha'"):
        _plan(engine, "beta", "gpu03", "gpu[02-04]")
    with pytest.raises(Conflict, match=r"controller: head already belongs to cluster 'alpha'"):
        _plan(engine, "beta", "head", "gpu[03-04]")
    assert {c for c, _n, _r in _rows(engine)} == {"alpha"}  # nothing of beta was recorded

    # a redeploy moves the members: the old controller leaves, a member becomes the controller
    _plan(engine, "alpha", "gpu02", "gpu[01-02]")
    assert _rows(engine) == {("alpha", "gpu01", "compute"), ("alpha", "gpu02", "compute")}
    _plan(engine, "alpha", "gpu03", "gpu01")
    assert _rows(engine) == {("alpha", "gpu01", "compute"), ("alpha", "gpu03", "controller")}
    _plan(engine, "beta", "head", "gpu[02,04]")  # free again
    assert wlm_api.get("/api/v1/wlm/beta").json()["nodes"] == "gpu[02,04]"


def test_drains_go_to_the_deployed_cluster_of_each_compute_member(wlm_api: Any, engine: Any) -> None:
    from bcm.db import session_scope
    from bcm.errors import Conflict
    from bcm.services import wlm as wlm_svc

    r = wlm_api.post("/api/v1/nodes/bulk", json={"nodes": "head,login,gpu[01-04]", "ip": "198.18.9.10"})
    assert r.status_code == 201, r.text
    inventoried(engine, "head", "login", "gpu01", "gpu02", "gpu03", "gpu04")
    _plan(engine, "alpha", "head", "gpu[01-02]")
    _plan(engine, "beta", "login", "gpu[03-04]")
    with session_scope(engine) as s:
        assert wlm_svc.wlm_members(s, ["gpu01", "gpu03"]) == []  # deploying: not yet drained through them
    _deployed(engine, "alpha")
    _deployed(engine, "beta")
    with session_scope(engine) as s:
        assert wlm_svc.wlm_members(s, ["head", "gpu03", "gpu01"]) == ["gpu03", "gpu01"]
        assert wlm_svc.clusters_of(s, ["gpu04", "gpu01", "gpu02"]) == {
            "alpha": ["gpu01", "gpu02"],
            "beta": ["gpu04"],
        }
        with pytest.raises(Conflict, match="head"):  # a controller only is in no workload manager's nodes
            wlm_svc.clusters_of(s, ["gpu01", "head"])


def test_rm_forgets_a_cluster_and_frees_its_nodes(wlm_api: Any, engine: Any) -> None:
    assert (
        wlm_api.post("/api/v1/nodes/bulk", json={"nodes": "gpu01,head", "ip": "198.18.9.10"}).status_code
        == 201
    )
    inventoried(engine, "head", "gpu01")
    _plan(engine, "lab", "head", "gpu01")
    from bcm.models.wlm import WlmCluster, WlmState

    with Session(engine) as s:  # a deploy in flight cannot be forgotten
        row = s.exec(select(WlmCluster)).one()
        row.state = WlmState.DEPLOYING.value
        s.add(row)
        s.commit()
    r = wlm_api.delete("/api/v1/wlm/lab")
    assert r.status_code == 409 and "deploying" in r.json()["message"]
    with Session(engine) as s:
        row = s.exec(select(WlmCluster)).one()
        row.state = WlmState.FAILED.value
        s.add(row)
        s.commit()
    assert wlm_api.delete("/api/v1/wlm/lab").status_code == 204
    assert wlm_api.get("/api/v1/wlm").json() == [] and _rows(engine) == set()
    assert wlm_api.delete("/api/v1/wlm/lab").status_code == 404
    assert wlm_api.delete("/api/v1/nodes", params={"nodes": "head"}).status_code in (200, 204)


def test_deleting_a_clusters_controller_is_409_naming_the_cluster(wlm_api: Any, engine: Any) -> None:
    assert (
        wlm_api.post("/api/v1/nodes/bulk", json={"nodes": "gpu01,head", "ip": "198.18.9.10"}).status_code
        == 201
    )
    inventoried(engine, "head", "gpu01")
    _plan(engine, "lab", "head", "gpu01")
    r = wlm_api.delete("/api/v1/nodes", params={"nodes": "head,gpu01"})
    assert (
        r.status_code == 409
        and "head (cluster lab)" in r.json()["message"]
        and "bcm wlm rm" in r.json()["message"]
    )
    assert len(wlm_api.get("/api/v1/nodes").json()["items"]) == 2  # nothing deleted
    assert wlm_api.delete("/api/v1/nodes", params={"nodes": "gpu01"}).status_code in (
        200,
        204,
    )  # a member may go
