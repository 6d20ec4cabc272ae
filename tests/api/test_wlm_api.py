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


def test_drain_of_nodes_outside_any_cluster_is_409(wlm_api: Any) -> None:
    assert wlm_api.post("/api/v1/nodes/bulk", json={"nodes": "gpu01"}).status_code == 201
    r = wlm_api.post("/api/v1/wlm/actions/drain", json={"nodes": "gpu01", "reason": "x"})
    assert r.status_code == 409 and "gpu01" in r.json()["message"]


def test_status_of_unknown_cluster_is_404(wlm_api: Any) -> None:
    assert wlm_api.get("/api/v1/wlm/nope").status_code == 404
    assert wlm_api.post("/api/v1/wlm/nope/verify").status_code == 404
