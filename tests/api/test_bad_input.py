"""Table-driven malformed requests: each gets a 4xx naming the field, and the database is unchanged."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text

TABLES = (
    "node",
    "interface",
    "category",
    "gpu",
    "operation",
    "image",
    "imageartifact",
    "department",
    "project",
    "project_member",
)

CASES: list[tuple[str, str, str, Any, int, str | None]] = [
    # id, method, path, body, status, field named in the answer
    ("bad-mac", "POST", "/api/v1/nodes", {"name": "z1", "mac": "52:54:00:zz:00:01"}, 422, "mac"),
    ("short-mac", "POST", "/api/v1/nodes/bulk", {"nodes": "z[1-2]", "mac": "52:54:00:00:01"}, 422, "mac"),
    ("multicast-mac", "POST", "/api/v1/nodes", {"name": "z1", "mac": "01:00:5e:00:00:01"}, 422, "mac"),
    ("bad-ip", "POST", "/api/v1/nodes", {"name": "z1", "ip": "198.18.0.300"}, 422, "ip"),
    ("bad-ip-bulk", "POST", "/api/v1/nodes/bulk", {"nodes": "z[1-2]", "ip": "not-an-ip"}, 422, "ip"),
    ("bad-name", "POST", "/api/v1/nodes", {"name": "GPU_01"}, 422, "name"),
    ("long-name", "POST", "/api/v1/nodes", {"name": "a" * 64}, 422, "name"),
    ("bad-hostlist", "POST", "/api/v1/nodes/bulk", {"nodes": "gpu[01-"}, 422, "nodes"),
    ("reversed-range", "POST", "/api/v1/nodes/bulk", {"nodes": "gpu[9-1]"}, 422, "nodes"),
    ("bad-name-in-hostlist", "POST", "/api/v1/nodes/bulk", {"nodes": "gpu[1-2],Bad_Name"}, 422, "nodes"),
    (
        "unknown-category",
        "POST",
        "/api/v1/nodes/bulk",
        {"nodes": "z[1-2]", "category": "nope"},
        422,
        "category",
    ),
    ("duplicate-name", "POST", "/api/v1/nodes", {"name": "keep1"}, 409, "name"),
    ("duplicate-in-bulk", "POST", "/api/v1/nodes/bulk", {"nodes": "z[1-3],keep2"}, 409, "name"),
    ("duplicate-mac", "POST", "/api/v1/nodes", {"name": "z1", "mac": "52:54:00:00:00:01"}, 409, "mac"),
    (
        "duplicate-mac-in-range",
        "POST",
        "/api/v1/nodes/bulk",
        {"nodes": "z[1-4]", "mac": "52:54:00:ff:ff:fe"},
        409,
        "mac",
    ),
    ("duplicate-ip", "POST", "/api/v1/nodes/bulk", {"nodes": "z[1-9]", "ip": "198.18.0.5"}, 409, "ip"),
    (
        "mac-range-overflow",
        "POST",
        "/api/v1/nodes/bulk",
        {"nodes": "z[1-3]", "mac": "fe:ff:ff:ff:ff:fe"},
        422,
        "mac",
    ),
    ("oversize-comment", "POST", "/api/v1/nodes", {"name": "z1", "comment": "x" * 5000}, 422, "comment"),
    ("wrong-type", "POST", "/api/v1/nodes", {"name": 12}, 422, "name"),
    ("missing-name", "POST", "/api/v1/nodes", {"mac": "52:54:00:00:99:01"}, 422, "name"),
    ("bad-start-state", "POST", "/api/v1/nodes", {"name": "z1", "state": "ready"}, 422, "state"),
    ("bad-category-name", "POST", "/api/v1/categories", {"name": "Bad Cat"}, 422, "name"),
    (
        "bad-health-policy",
        "POST",
        "/api/v1/categories",
        {"name": "hp", "health_policy": {"nope": 1}},
        422,
        "health_policy.nope",
    ),
    ("duplicate-category", "POST", "/api/v1/categories", {"name": "gpu"}, 409, "name"),
    ("bad-limit", "GET", "/api/v1/nodes?limit=0", None, 422, "limit"),
    ("bad-state-filter", "GET", "/api/v1/nodes?state=sleeping", None, 422, "state"),
    (
        "patch-bad-iface",
        "PATCH",
        "/api/v1/nodes/keep1",
        {"interfaces": [{"mac": "nope"}]},
        422,
        "interfaces.0.mac",
    ),
    ("patch-dup-iface-ip", "PATCH", "/api/v1/nodes/keep2", {"interfaces": [{"ip": "198.18.0.1"}]}, 409, "ip"),
    ("patch-unknown-category", "PATCH", "/api/v1/nodes/keep1", {"category": "nope"}, 422, "category"),
    ("bad-token-role", "POST", "/api/v1/tokens", {"name": "t", "role": "god"}, 422, "role"),
    ("not-json", "POST", "/api/v1/nodes", "this is not json", 422, "body"),
    (
        "bad-bmc-protocol",
        "POST",
        "/api/v1/nodes",
        {"name": "z1", "bmc_protocol": "snmp"},
        422,
        "bmc_protocol",
    ),
    (
        "bad-bmc-address",
        "POST",
        "/api/v1/nodes",
        {"name": "z1", "bmc_address": "http://"},
        422,
        "bmc_address",
    ),
    ("bad-bmc-port", "PATCH", "/api/v1/nodes/keep1", {"bmc_address": "198.18.0.9:70000"}, 422, "bmc_address"),
    ("bad-bmc-user", "POST", "/api/v1/nodes/bulk", {"nodes": "z[1-2]", "bmc_user": "a b"}, 422, "bmc_user"),
    (
        "bad-category-bmc",
        "POST",
        "/api/v1/categories",
        {"name": "c1", "bmc_protocol": "x"},
        422,
        "bmc_protocol",
    ),
    (
        "empty-bmc-password",
        "PUT",
        "/api/v1/nodes/bmc-password",
        {"nodes": "keep1", "password": ""},
        422,
        "password",
    ),
    ("bad-power-action", "POST", "/api/v1/nodes/actions/power-sideways", {"nodes": "keep1"}, 422, "action"),
    ("power-bad-hostlist", "POST", "/api/v1/nodes/actions/power-on", {"nodes": "gpu[01-"}, 422, "nodes"),
    ("cancel-op-not-a-number", "POST", "/api/v1/operations/abc/cancel", None, 422, "op_id"),
    ("cancel-op-zero", "POST", "/api/v1/operations/0/cancel", None, 422, "op_id"),
    ("cancel-op-too-big", "POST", "/api/v1/operations/99999999999999999999/cancel", None, 422, "op_id"),
    ("unknown-recipe", "POST", "/api/v1/images/build", {"recipe": "nope"}, 422, "recipe"),
    ("bad-recipe-name", "POST", "/api/v1/images/build", {"recipe": "Bad Name"}, 422, "recipe"),
    (
        "bad-image-version",
        "POST",
        "/api/v1/images/build",
        {"recipe": "base", "version": "../x"},
        422,
        "version",
    ),
    ("unknown-build-field", "POST", "/api/v1/images/build", {"recipe": "base", "force": True}, 422, "force"),
    ("bad-image-version-filter", "GET", "/api/v1/images/base?version=a%20b", None, 422, "version"),
    ("rollback-unknown-image", "POST", "/api/v1/images/nope/rollback", None, 404, None),
    ("push-bad-hostlist", "POST", "/api/v1/images/base/push", {"nodes": "keep[1-"}, 422, "nodes"),
    (
        "push-unknown-field",
        "POST",
        "/api/v1/images/base/push",
        {"nodes": "keep1", "force": True},
        422,
        "force",
    ),
    ("push-unknown-image", "POST", "/api/v1/images/nope/push", {"nodes": "keep1"}, 404, None),
    ("dept-bad-name", "POST", "/api/v1/departments", {"name": "Bad_D", "gpu_quota": 1}, 422, "name"),
    ("dept-reserved-name", "POST", "/api/v1/departments", {"name": "root", "gpu_quota": 1}, 422, "name"),
    ("dept-negative-quota", "POST", "/api/v1/departments", {"name": "d9", "gpu_quota": -1}, 422, "gpu_quota"),
    (
        "dept-quota-overflow",
        "POST",
        "/api/v1/departments",
        {"name": "d9", "gpu_quota": 2**31},
        422,
        "gpu_quota",
    ),
    ("dept-patch-zero-share", "PATCH", "/api/v1/departments/nope", {"fairshare": 0}, 422, "fairshare"),
    (
        "project-unknown-dept",
        "POST",
        "/api/v1/projects",
        {"name": "p9", "department": "nope", "deserved_gpus": 1},
        404,
        None,
    ),
    (
        "project-zero-share",
        "POST",
        "/api/v1/projects",
        {"name": "p9", "department": "nope", "deserved_gpus": 1, "fairshare": 0},
        422,
        "fairshare",
    ),
    ("member-bad-user", "POST", "/api/v1/projects/nope/members", {"user": "Bad User"}, 422, "user"),
]


def snapshot(engine: Any) -> dict[str, list[Any]]:
    with engine.connect() as conn:
        return {t: [tuple(r) for r in conn.execute(text(f"SELECT * FROM {t} ORDER BY id"))] for t in TABLES}


@pytest.fixture
def seeded(api: Any, engine: Any) -> Any:
    assert (
        api.post(
            "/api/v1/nodes", json={"name": "keep1", "mac": "52:54:00:00:00:01", "ip": "198.18.0.1"}
        ).status_code
        == 201
    )
    assert (
        api.post(
            "/api/v1/nodes/bulk", json={"nodes": "keep[2-3]", "mac": "52:54:00:ff:ff:ff", "ip": "198.18.0.10"}
        ).status_code
        == 201
    )
    assert api.post("/api/v1/nodes", json={"name": "keep4", "ip": "198.18.0.5"}).status_code == 201
    return api


def test_table_has_enough_cases() -> None:
    assert len(CASES) >= 15 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    ("case", "method", "path", "body", "status", "field"), CASES, ids=[c[0] for c in CASES]
)
def test_malformed_request(
    seeded: Any, engine: Any, case: str, method: str, path: str, body: Any, status: int, field: str | None
) -> None:
    before = snapshot(engine)
    if isinstance(body, str):
        r = seeded.request(method, path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = seeded.request(method, path, json=body)
    assert r.status_code == status, r.text
    answer = r.json()
    if field is None:  # a 404 names the thing it did not find, not a field
        assert "nope" in answer["message"], answer
        assert snapshot(engine) == before
        return
    assert answer["field"] == field, answer
    assert field.split(".")[-1] in answer["message"] or answer["field"] == "body", answer
    assert snapshot(engine) == before
