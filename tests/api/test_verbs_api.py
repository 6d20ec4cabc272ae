"""Verbs through the API: every state × verb answers 200 or 409, locks give 409, drains are recorded."""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import update
from sqlmodel import Session

from bcm.domain.states import PUBLIC_VERBS, TRANSITIONS, State
from bcm.models.base import utcnow
from bcm.models.node import Node


def set_state(engine: Any, name: str, state: State) -> None:
    with Session(engine) as s:
        s.execute(update(Node).where(Node.name == name).values(provision_state=state.value))  # type: ignore[arg-type]
        s.commit()


def test_every_state_and_verb_over_http(api: Any, engine: Any) -> None:
    # inventory starts background work with SSH; its transition is covered by the unit table and lab tests
    verbs = sorted(v.value for v in PUBLIC_VERBS if v.value != "inventory")
    names = [f"s{i:03d}" for i in range(len(State) * len(verbs))]
    assert api.post("/api/v1/nodes/bulk", json={"nodes": f"s[000-{len(names) - 1:03d}]"}).status_code == 201
    for name, (state, verb) in zip(names, itertools.product(State, verbs), strict=True):
        set_state(engine, name, state)
        r = api.post(f"/api/v1/nodes/actions/{verb}", json={"nodes": name, "reason": "test"})
        expected = TRANSITIONS.get((state, verb))  # type: ignore[call-overload]
        after = api.get(f"/api/v1/nodes/{name}").json()["provision_state"]
        if expected is None:
            assert r.status_code == 409, (state, verb, r.text)
            body = r.json()
            assert body["error"] == "IllegalTransition"
            assert name in body["message"] and state.value in body["message"] and verb in body["message"]
            assert after == state.value
        elif verb in ("provision", "reimage"):
            # the verb answers the state it wrote; the provisioning queue then works on the node (these have
            # no BMC, so it fails them with a reason: tests/api/test_pxe_api.py)
            assert r.status_code == 200, (state, verb, r.text)
            assert r.json()["nodes"][0]["state"] == expected.value
            assert after in (expected.value, State.FAILED.value)
        else:
            assert r.status_code == 200, (state, verb, r.text)
            assert after == expected.value


def test_bulk_verb_is_all_or_nothing(api: Any, engine: Any) -> None:
    api.post("/api/v1/nodes/bulk", json={"nodes": "g[1-3]"})
    for n in ("g1", "g2"):
        set_state(engine, n, State.READY)
    r = api.post("/api/v1/nodes/actions/drain", json={"nodes": "g[1-3]"})
    assert r.status_code == 409 and "g3" in r.json()["message"] and "g1" not in r.json()["message"]
    states = [api.get(f"/api/v1/nodes/g{i}").json()["provision_state"] for i in (1, 2, 3)]
    assert states == ["ready", "ready", "registered"]
    r = api.post("/api/v1/nodes/actions/drain", json={"nodes": "g[1-2]", "reason": "fan swap"})
    assert r.status_code == 200
    assert [n["state"] for n in r.json()["nodes"]] == ["drained", "drained"]
    drains = api.get("/api/v1/events", params={"action": "node.drain"}).json()
    assert drains[0]["message"] == "fan swap"


def test_unknown_verb_and_unknown_node(api: Any) -> None:
    api.post("/api/v1/nodes", json={"name": "x1"})
    r = api.post("/api/v1/nodes/actions/explode", json={"nodes": "x1"})
    assert r.status_code == 422 and r.json()["field"] == "verb"
    r = api.post("/api/v1/nodes/actions/drain", json={"nodes": "x[1-3]"})
    assert r.status_code == 404 and "x[2-3]" in r.json()["message"]


@pytest.mark.parametrize("expired", [False, True])
def test_node_lock_blocks_verbs_until_it_expires(api: Any, engine: Any, expired: bool) -> None:
    api.post("/api/v1/nodes", json={"name": "l1"})
    set_state(engine, "l1", State.READY)
    until = utcnow() + timedelta(seconds=-5 if expired else 600)
    with Session(engine) as s:
        s.execute(update(Node).where(Node.name == "l1").values(lock_owner="op-x", lock_expires=until))  # type: ignore[arg-type]
        s.commit()
    r = api.post("/api/v1/nodes/actions/drain", json={"nodes": "l1"})
    if expired:
        assert r.status_code == 200
    else:
        assert r.status_code == 409 and r.json()["error"] == "LockHeld" and "op-x" in r.json()["message"]
        assert api.patch("/api/v1/nodes/l1", json={"comment": "x"}).status_code == 409
        assert api.get("/api/v1/nodes/l1").json()["locked_by"] == "op-x"


def test_lock_acquisition_is_exclusive(engine: Any) -> None:
    from bcm.errors import LockHeld
    from bcm.services import nodes as svc

    with Session(engine) as s:
        s.add(Node(name="k1"))
        s.add(Node(name="k2"))
        s.commit()
    with Session(engine) as s:
        svc.acquire_locks(s, ["k1"], "op-a")
        s.commit()
    with Session(engine) as s, pytest.raises(LockHeld):
        svc.acquire_locks(s, ["k1", "k2"], "op-b")
    with Session(engine) as s:  # the failed attempt left k2 free
        svc.acquire_locks(s, ["k2"], "op-b")
        svc.release_locks(s, ["k1"], "op-a")
        s.commit()
        assert s.get(Node, 1) is not None
