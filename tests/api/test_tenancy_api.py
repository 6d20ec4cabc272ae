"""Departments, projects and their bindings over HTTP: the quota invariants (422 naming the numbers),
and who may do what, as a table of caller × target × action written apart from bcm's own table."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

A = "allow"
D = "deny"


def _token(api: Any, user: str | None, role: str) -> dict[str, str]:
    if user is not None:
        r = api.post("/api/v1/users", json={"name": user, "role": role})
        assert r.status_code == 201, r.text
    r = api.post("/api/v1/tokens", json={"name": f"t-{user or role}", "role": role, "user": user})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


def _ok(r: Any, code: int = 200) -> Any:
    assert r.status_code == code, r.text
    return r.json()


@pytest.fixture
def world(api: Any) -> dict[str, dict[str, str]]:
    """d1 (p1) and d2 (p2); alice admin of d1, bob member of p1, and callers of each system role."""
    _ok(api.post("/api/v1/departments", json={"name": "d1", "gpu_quota": 10}), 201)
    _ok(api.post("/api/v1/departments", json={"name": "d2", "gpu_quota": 10}), 201)
    _ok(api.post("/api/v1/projects", json={"name": "p1", "department": "d1", "deserved_gpus": 2}), 201)
    _ok(api.post("/api/v1/projects", json={"name": "p2", "department": "d2", "deserved_gpus": 2}), 201)
    callers = {
        "admin": {},
        "operator": _token(api, "olga", "operator"),
        "viewer": _token(api, "vera", "viewer"),
        "nobody": _token(api, "nora", "user"),
        "dept-admin": _token(api, "alice", "user"),
        "member": _token(api, "bob", "user"),
    }
    _token(api, "eve", "user")
    _ok(api.post("/api/v1/departments/d1/admins", json={"user": "alice"}), 201)
    _ok(api.post("/api/v1/projects/p1/members", json={"user": "bob"}), 201)
    return callers


# action -> (request on the caller's own department d1 / project p1, or the other d2 / p2; cleanup)
Req = Callable[[Any, dict[str, str], str, str, int], Any]


def _read_dept(api: Any, h: dict[str, str], d: str, p: str, i: int) -> Any:
    return api.get(f"/api/v1/departments/{d}", headers=h)


def _update_dept(api: Any, h: dict[str, str], d: str, p: str, i: int) -> Any:
    return api.patch(f"/api/v1/departments/{d}", json={"fairshare": 3}, headers=h)


def _delete_dept(api: Any, h: dict[str, str], d: str, p: str, i: int) -> Any:
    name = f"gone{i}"
    _ok(api.post("/api/v1/departments", json={"name": name, "gpu_quota": 1}), 201)
    if d == "d1":  # the caller's own: alice administers it too
        _ok(api.post(f"/api/v1/departments/{name}/admins", json={"user": "alice"}), 201)
    return api.delete(f"/api/v1/departments/{name}", headers=h)


def _create_dept(api: Any, h: dict[str, str], d: str, p: str, i: int) -> Any:
    return api.post("/api/v1/departments", json={"name": f"new{i}", "gpu_quota": 1}, headers=h)


def _manage_admins(api: Any, h: dict[str, str], d: str, p: str, i: int) -> Any:
    r = api.post(f"/api/v1/departments/{d}/admins", json={"user": "eve"}, headers=h)
    if r.status_code == 201:
        _ok(api.delete(f"/api/v1/departments/{d}/admins/eve"))
    return r


def _read_project(api: Any, h: dict[str, str], d: str, p: str, i: int) -> Any:
    return api.get(f"/api/v1/projects/{p}", headers=h)


def _create_project(api: Any, h: dict[str, str], d: str, p: str, i: int) -> Any:
    r = api.post("/api/v1/projects", json={"name": f"np{i}", "department": d, "deserved_gpus": 1}, headers=h)
    if r.status_code == 201:
        _ok(api.delete(f"/api/v1/projects/np{i}"))
    return r


def _update_project(api: Any, h: dict[str, str], d: str, p: str, i: int) -> Any:
    return api.patch(f"/api/v1/projects/{p}", json={"fairshare": 2}, headers=h)


def _delete_project(api: Any, h: dict[str, str], d: str, p: str, i: int) -> Any:
    _ok(api.post("/api/v1/projects", json={"name": f"tmp{i}", "department": d, "deserved_gpus": 0}), 201)
    if p == "p1":
        _ok(api.post(f"/api/v1/projects/tmp{i}/members", json={"user": "bob"}), 201)
    return api.delete(f"/api/v1/projects/tmp{i}", headers=h)


def _members(api: Any, h: dict[str, str], d: str, p: str, i: int) -> Any:
    r = api.post(f"/api/v1/projects/{p}/members", json={"user": "eve"}, headers=h)
    if r.status_code == 201:
        _ok(api.delete(f"/api/v1/projects/{p}/members/eve"))
    return r


def _usage(api: Any, h: dict[str, str], d: str, p: str, i: int) -> Any:
    return api.get(f"/api/v1/projects/{p}/usage", headers=h)


def _plan(api: Any, h: dict[str, str], d: str, p: str, i: int) -> Any:
    return api.get("/api/v1/tenancy/plan", headers=h)


def _apply(api: Any, h: dict[str, str], d: str, p: str, i: int) -> Any:
    return api.post("/api/v1/tenancy/apply", headers=h)


ACTIONS: dict[str, Req] = {
    "read-department": _read_dept,
    "update-department": _update_dept,
    "delete-department": _delete_dept,
    "create-department": _create_dept,
    "manage-admins": _manage_admins,
    "read-project": _read_project,
    "create-project": _create_project,
    "update-project": _update_project,
    "delete-project": _delete_project,
    "manage-members": _members,
    "read-usage": _usage,
    "plan": _plan,
    "apply": _apply,
}

# caller, target ("own": d1/p1, "other": d2/p2) -> the actions allowed; every other action is a 403
ALL = set(ACTIONS)
READS = {"read-department", "read-project", "read-usage", "plan"}
OPERATOR = READS | {
    "update-department",
    "create-department",
    "create-project",
    "update-project",
    "manage-members",
    "apply",
}
DEPT_ADMIN = {
    "read-department",
    "read-project",
    "create-project",
    "update-project",
    "delete-project",
    "manage-members",
    "read-usage",
}
EXPECTED: dict[tuple[str, str], set[str]] = {
    ("admin", "own"): ALL,
    ("admin", "other"): ALL,
    ("operator", "own"): OPERATOR,
    ("operator", "other"): OPERATOR,
    ("viewer", "own"): READS,
    ("viewer", "other"): READS,
    ("nobody", "own"): set(),
    ("nobody", "other"): set(),
    ("dept-admin", "own"): DEPT_ADMIN,
    ("dept-admin", "other"): set(),
    ("member", "own"): {"read-usage"},
    ("member", "other"): set(),
}
# allowed, but the work itself has nowhere to go: no workload-manager cluster in this database
NO_CLUSTER = {"plan", "apply"}


def test_role_scope_action_table(api: Any, world: dict[str, dict[str, str]]) -> None:
    wrong = []
    i = 0
    for (caller, target), allowed in EXPECTED.items():
        d, p = ("d1", "p1") if target == "own" else ("d2", "p2")
        for action, req in ACTIONS.items():
            i += 1
            r = req(api, world[caller], d, p, i)
            if action in allowed:
                good = r.status_code == 404 if action in NO_CLUSTER else r.status_code in (200, 201)
            else:
                good = r.status_code == 403 and "may not" in r.json()["message"]
            if not good:
                wrong.append((caller, target, action, r.status_code, r.text[:200]))
    assert wrong == []


def test_lists_show_only_what_the_caller_may_read(api: Any, world: dict[str, dict[str, str]]) -> None:
    def names(path: str, who: str) -> list[str]:
        return [x["name"] for x in _ok(api.get(path, headers=world[who]))]

    assert names("/api/v1/departments", "viewer") == ["d1", "d2"]
    assert names("/api/v1/departments", "dept-admin") == ["d1"]
    assert names("/api/v1/projects", "dept-admin") == ["p1"]
    assert names("/api/v1/departments", "member") == [] and names("/api/v1/projects", "member") == []
    assert names("/api/v1/projects", "nobody") == []
    usage = _ok(api.get("/api/v1/projects/p1/usage", headers=world["member"]))
    assert usage["deserved_gpus"] == 2 and usage["wlm"] is None


def test_quota_invariants_name_the_numbers(api: Any) -> None:
    _ok(api.post("/api/v1/departments", json={"name": "d1", "gpu_quota": 8}), 201)
    _ok(api.post("/api/v1/departments", json={"name": "d2", "gpu_quota": 3}), 201)
    _ok(api.post("/api/v1/projects", json={"name": "p1", "department": "d1", "deserved_gpus": 5}), 201)
    # the deserved quotas of a department's projects exceed the department's quota
    r = api.post("/api/v1/projects", json={"name": "p2", "department": "d1", "deserved_gpus": 4})
    body = r.json()
    assert r.status_code == 422 and body["field"] == "deserved_gpus", body
    assert all(n in body["message"] for n in ("8", "5", "4", "9")), body
    r = api.patch("/api/v1/projects/p1", json={"deserved_gpus": 9, "limit_gpus": 9})
    assert r.status_code == 422 and "9" in r.json()["message"] and "8" in r.json()["message"], r.text
    r = api.patch("/api/v1/departments/d1", json={"gpu_quota": 4})
    assert r.status_code == 422 and r.json()["field"] == "gpu_quota", r.text
    assert "4" in r.json()["message"] and "5" in r.json()["message"]
    # a limit below the deserved quota
    r = api.post(
        "/api/v1/projects", json={"name": "p3", "department": "d1", "deserved_gpus": 2, "limit_gpus": 1}
    )
    assert r.status_code == 422 and r.json()["field"] == "limit_gpus", r.text
    assert "1" in r.json()["message"] and "2" in r.json()["message"]
    r = api.patch("/api/v1/projects/p1", json={"limit_gpus": 4})
    assert r.status_code == 422 and "4" in r.json()["message"] and "5" in r.json()["message"], r.text
    # a project moved to a department that cannot hold it
    r = api.patch("/api/v1/projects/p1", json={"department": "d2"})
    assert r.status_code == 422 and r.json()["field"] == "department", r.text
    assert "3" in r.json()["message"] and "5" in r.json()["message"]
    # nothing of the refused changes was kept
    p1 = _ok(api.get("/api/v1/projects/p1"))
    assert (p1["department"], p1["deserved_gpus"], p1["limit_gpus"]) == ("d1", 5, 5)
    assert _ok(api.get("/api/v1/departments/d1"))["gpu_quota"] == 8
    # what fits is taken; the limit may exceed the department's quota (GPUs others leave idle)
    _ok(
        api.post(
            "/api/v1/projects", json={"name": "p2", "department": "d1", "deserved_gpus": 3, "limit_gpus": 16}
        ),
        201,
    )
    assert _ok(api.get("/api/v1/departments/d1"))["deserved_gpus"] == 8
    _ok(api.patch("/api/v1/departments/d2", json={"gpu_quota": 5}))
    moved = _ok(api.patch("/api/v1/projects/p1", json={"department": "d2"}))
    assert moved["department"] == "d2"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/api/v1/departments", {"name": "Bad_Name", "gpu_quota": 1}, "name"),
        ("/api/v1/departments", {"name": "root", "gpu_quota": 1}, "name"),
        ("/api/v1/departments", {"name": "x" * 41, "gpu_quota": 1}, "name"),
        ("/api/v1/departments", {"name": "d9", "gpu_quota": -1}, "gpu_quota"),
        ("/api/v1/departments", {"name": "d9", "gpu_quota": 2**31}, "gpu_quota"),
        ("/api/v1/departments", {"name": "d9", "gpu_quota": 1, "fairshare": 0}, "fairshare"),
        ("/api/v1/projects", {"name": "p9", "department": "d1", "deserved_gpus": 2**31}, "deserved_gpus"),
        (
            "/api/v1/projects",
            {"name": "p9", "department": "d1", "deserved_gpus": 1, "limit_gpus": 2**40},
            "limit_gpus",
        ),
        (
            "/api/v1/projects",
            {"name": "p9", "department": "d1", "deserved_gpus": 1, "fairshare": 2**31},
            "fairshare",
        ),
        ("/api/v1/projects", {"name": "p9", "department": "NO", "deserved_gpus": 1}, "department"),
        ("/api/v1/projects/p1/members", {"user": "x" * 33}, "user"),
    ],
)
def test_bad_input_names_the_field(api: Any, path: str, body: dict[str, Any], field: str) -> None:
    _ok(api.post("/api/v1/departments", json={"name": "d1", "gpu_quota": 4}), 201)
    _ok(api.post("/api/v1/projects", json={"name": "p1", "department": "d1", "deserved_gpus": 1}), 201)
    if body.get("user", "").startswith("x"):
        _ok(api.post("/api/v1/users", json={"name": body["user"], "role": "user"}), 201)
    before = (api.get("/api/v1/departments").json(), api.get("/api/v1/projects").json())
    r = api.post(path, json=body)
    assert r.status_code == 422, r.text
    assert field in r.text, r.text
    assert (api.get("/api/v1/departments").json(), api.get("/api/v1/projects").json()) == before


def test_names_are_one_namespace_and_removal_order(api: Any) -> None:
    _ok(api.post("/api/v1/departments", json={"name": "d1", "gpu_quota": 4}), 201)
    r = api.post("/api/v1/projects", json={"name": "d1", "department": "d1", "deserved_gpus": 1})
    assert r.status_code == 409 and "department" in r.json()["message"], r.text
    _ok(api.post("/api/v1/projects", json={"name": "p1", "department": "d1", "deserved_gpus": 1}), 201)
    r = api.delete("/api/v1/departments/d1")
    assert r.status_code == 409 and "p1" in r.json()["message"], r.text
    _ok(api.delete("/api/v1/projects/p1"))
    _ok(api.delete("/api/v1/departments/d1"))
    assert api.get("/api/v1/departments/d1").status_code == 404


def test_removing_a_user_removes_their_bindings(api: Any) -> None:
    _ok(api.post("/api/v1/departments", json={"name": "d1", "gpu_quota": 4}), 201)
    _ok(api.post("/api/v1/projects", json={"name": "p1", "department": "d1", "deserved_gpus": 1}), 201)
    _ok(api.post("/api/v1/users", json={"name": "zed", "role": "user"}), 201)
    _ok(api.post("/api/v1/projects/p1/members", json={"user": "zed"}), 201)
    _ok(api.post("/api/v1/departments/d1/admins", json={"user": "zed"}), 201)
    r = api.post("/api/v1/projects/p1/members", json={"user": "zed"})
    assert r.status_code == 409 and "zed" in r.json()["message"], r.text
    assert api.post("/api/v1/projects/p1/members", json={"user": "ghost"}).status_code == 404
    _ok(api.delete("/api/v1/users/zed"))
    assert _ok(api.get("/api/v1/projects/p1/members")) == []
    assert _ok(api.get("/api/v1/departments/d1"))["admins"] == []
