"""Tokens and roles: 401 without a valid token, 403 for a role that may not, secrets never listed."""

from __future__ import annotations

import stat
from typing import Any


def make_token(api: Any, role: str) -> str:
    r = api.post("/api/v1/tokens", json={"name": f"{role}-user", "role": role})
    assert r.status_code == 201, r.text
    return r.json()["token"]


def test_no_or_wrong_token_is_401(api: Any) -> None:
    good = api.headers.pop("Authorization")
    for headers in (
        {},
        {"Authorization": "Bearer bcm_wrong"},
        {"Authorization": "Basic abc"},
        {"Authorization": good.replace("Bearer ", "Bearer x")},
    ):
        for path in (
            "/api/v1/nodes",
            "/api/v1/categories",
            "/api/v1/operations",
            "/api/v1/events",
            "/api/v1/tokens",
        ):
            r = api.get(path, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert "token" in r.json()["message"]


def test_roles(api: Any) -> None:
    viewer, operator = make_token(api, "viewer"), make_token(api, "operator")
    as_viewer = {"Authorization": f"Bearer {viewer}"}
    as_operator = {"Authorization": f"Bearer {operator}"}
    assert api.get("/api/v1/nodes", headers=as_viewer).status_code == 200
    r = api.post("/api/v1/nodes", json={"name": "v1"}, headers=as_viewer)
    assert r.status_code == 403 and "viewer" in r.json()["message"]
    assert api.post("/api/v1/nodes", json={"name": "o1"}, headers=as_operator).status_code == 201
    assert api.get("/api/v1/tokens", headers=as_operator).status_code == 403
    assert (
        api.post("/api/v1/tokens", json={"name": "x", "role": "admin"}, headers=as_operator).status_code
        == 403
    )
    assert api.delete("/api/v1/nodes/o1", headers=as_operator).status_code == 403
    assert api.get("/api/v1/nodes", params={"state": "registered"}).json()["total"] == 1


def test_revoked_token_stops_working_and_secrets_are_not_listed(api: Any, settings: Any) -> None:
    secret = make_token(api, "viewer")
    listed = api.get("/api/v1/tokens").json()
    assert all("token" not in t and "token_hash" not in t for t in listed)
    assert secret not in api.get("/api/v1/tokens").text
    tid = next(t["id"] for t in listed if t["name"] == "viewer-user")
    assert api.delete(f"/api/v1/tokens/{tid}").status_code == 200
    assert api.get("/api/v1/nodes", headers={"Authorization": f"Bearer {secret}"}).status_code == 401
    assert api.delete("/api/v1/tokens/9999").status_code == 404


def test_bootstrap_token_file_is_private(settings: Any, api: Any) -> None:
    mode = stat.S_IMODE(settings.admin_token_file.stat().st_mode)
    assert mode == 0o600
    assert settings.admin_token_file.read_text().startswith("bcm_")


# probes reveal nothing but up/ready; boot artifacts are what PXE clients fetch (images hold no secrets)
# boot endpoints that reveal no secret (the overlay and the callback take a one-time boot token instead);
# the API's CA certificate is public (`bcm ca fetch` checks it by fingerprint)
PUBLIC = {
    "/healthz",
    "/readyz",
    "/leaderz",
    "/boot/v1/images/{name}/{version}/{filename}",
    "/boot/v1/ipxe/boot.ipxe",
    "/boot/v1/ipxe/{mac}",
    "/boot/v1/discover",
    "/boot/v1/ca.pem",
}


def routes(api: Any) -> list[tuple[str, str]]:
    """Every (path, method) the app documents."""
    spec = api.get("/openapi.json").json()
    return [(path, method.upper()) for path, ops in spec["paths"].items() for method in ops]


def test_every_route_needs_a_token(api: Any) -> None:
    """Walk the app's routes: without a token each one answers 401, before it looks at the body."""
    documented = routes(api)  # the document itself needs a token too (checked below)
    api.headers.pop("Authorization")
    assert api.get("/openapi.json").status_code == 401
    checked = 0
    for route, method in documented:
        if route in PUBLIC:
            continue
        r = api.request(method, route.replace("{", "").replace("}", ""), json={})
        assert r.status_code == 401, (method, route, r.status_code, r.text)
        assert "bcm_" not in r.text
        checked += 1
    assert checked >= 30


def test_viewer_cannot_write_anywhere(api: Any) -> None:
    viewer = make_token(api, "viewer")
    writes = [(r, m) for r, m in routes(api) if r.startswith("/api/v1") and m != "GET"]
    assert len(writes) >= 18
    for route, method in writes:
        r = api.request(
            method,
            route.replace("{", "").replace("}", ""),
            json={},
            headers={"Authorization": f"Bearer {viewer}"},
        )
        assert r.status_code == 403, (method, route, r.status_code, r.text)


def test_users_own_tokens_that_never_exceed_their_role(api: Any) -> None:
    assert (
        api.post(
            "/api/v1/users", json={"name": "alice", "role": "operator", "full_name": "Alice A."}
        ).status_code
        == 201
    )
    r = api.post("/api/v1/users", json={"name": "alice", "role": "viewer"})
    assert r.status_code == 409 and r.json()["field"] == "name"
    assert api.post("/api/v1/users", json={"name": "robot", "role": "node"}).status_code == 422
    r = api.post("/api/v1/tokens", json={"name": "alice-admin", "role": "admin", "user": "alice"})
    assert r.status_code == 422 and r.json()["field"] == "role" and "alice" in r.json()["message"]
    assert (
        api.post("/api/v1/tokens", json={"name": "x", "role": "viewer", "user": "nobody"}).status_code == 404
    )
    r = api.post("/api/v1/tokens", json={"name": "alice-laptop", "role": "operator", "user": "alice"})
    assert r.status_code == 201 and r.json()["user"] == "alice"
    secret = r.json()["token"]
    as_alice = {"Authorization": f"Bearer {secret}"}
    assert api.post("/api/v1/nodes", json={"name": "a1"}, headers=as_alice).status_code == 201
    users = {u["name"]: u for u in api.get("/api/v1/users").json()}
    assert users["alice"]["tokens"] == 1 and users["alice"]["role"] == "operator"
    assert api.get("/api/v1/users", headers=as_alice).status_code == 403
    # removing a user revokes their tokens at once
    assert api.delete("/api/v1/users/alice").status_code == 200
    assert api.get("/api/v1/nodes", headers=as_alice).status_code == 401
    assert api.delete("/api/v1/users/alice").status_code == 404
    assert [e["target"] for e in api.get("/api/v1/events", params={"action": "user.delete"}).json()] == [
        "alice"
    ]
