"""`tenancy apply` is an operation like every long verb: the request returns at once with its id, the
cluster's nodes are locked under its lease while it runs (a second apply is a 409), it is bounded and
ends with one result per node, its nodes unlocked — here against a controller whose SSH never answers."""

from __future__ import annotations

import time
from typing import Any

from bcm.db import session_scope
from bcm.models.node import NodeBulkCreate
from bcm.models.wlm import WlmCluster, WlmMember, WlmRole, WlmState
from bcm.services import nodes
from tests.faults.test_operations import ADDRESSES, silent_ssh  # noqa: F401  (a fixture)


def _cluster(engine: Any) -> None:
    with session_scope(engine) as s:
        nodes.bulk_create(s, NodeBulkCreate(nodes="tctl,tcn[1-2]", ip=ADDRESSES[0]), "test")
        by_name = {n.name: n for n in nodes.get_many(s, ["tctl", "tcn1", "tcn2"])}
        row = WlmCluster(name="lab", controller_id=by_name["tctl"].id, state=WlmState.DEPLOYED.value)
        s.add(row)
        s.flush()
        for name in ("tcn1", "tcn2"):
            s.add(WlmMember(cluster_id=row.id, node_id=by_name[name].id, role=WlmRole.COMPUTE.value))


def test_tenancy_apply_is_an_operation(api: Any, engine: Any, settings: Any, silent_ssh: int) -> None:  # noqa: F811
    settings.ssh.port, settings.ssh.connect_timeout_s = silent_ssh, 2
    _cluster(engine)
    r = api.post("/api/v1/tenancy/apply")
    assert r.status_code == 200, r.text
    assert r.json()["cluster"] == "lab"
    op_id = r.json()["operation_id"]
    op = api.get(f"/api/v1/operations/{op_id}").json()
    assert op["kind"] == "tenancy.apply" and op["progress_total"] == 3, op
    locked = {n["name"]: n["locked_by"] for n in api.get("/api/v1/nodes").json()["items"]}
    assert locked == {"tctl": f"op-{op_id}", "tcn1": f"op-{op_id}", "tcn2": f"op-{op_id}"}, locked
    again = api.post("/api/v1/tenancy/apply")
    assert again.status_code == 409 and "locked" in again.json()["message"], again.text
    for _ in range(300):  # bounded: the controller's connect timeout is 2 s
        op = api.get(f"/api/v1/operations/{op_id}").json()
        if op["state"] not in ("pending", "running"):
            break
        time.sleep(0.1)
    assert op["state"] == "failed" and op["error"], op
    assert set(op["results"]) == {"tctl", "tcn1", "tcn2"}, op["results"]
    assert op["outcome"] is None  # nothing was applied
    assert all(n["locked_by"] is None for n in api.get("/api/v1/nodes").json()["items"])
