"""Nodes and categories through the HTTP API, on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any


def add(api: Any, **body: Any) -> Any:
    return api.post("/api/v1/nodes/bulk", json=body)


def test_bulk_create_gives_consecutive_macs_and_ips(api: Any) -> None:
    r = add(api, nodes="gpu[01-04]", mac="52:54:00:00:00:ff", ip="198.18.0.254", category="gpu")
    assert r.status_code == 201, r.text
    nodes = {n["name"]: n for n in api.get("/api/v1/nodes").json()["items"]}
    assert list(nodes) == ["gpu01", "gpu02", "gpu03", "gpu04"]
    got = [(n["interfaces"][0]["mac"], n["interfaces"][0]["ip"]) for n in nodes.values()]
    assert got == [
        ("52:54:00:00:00:ff", "198.18.0.254"),
        ("52:54:00:00:01:00", "198.18.0.255"),
        ("52:54:00:00:01:01", "198.18.1.0"),
        ("52:54:00:00:01:02", "198.18.1.1"),
    ]
    assert all(n["category"] == "gpu" and n["provision_state"] == "registered" for n in nodes.values())


def test_single_node_with_interfaces_and_show(api: Any) -> None:
    body = {
        "name": "login1",
        "interfaces": [
            {"name": "eth0", "mac": "52:54:00:00:10:01", "ip": "198.18.0.2"},
            {"name": "ib0", "boot": False},
        ],
    }
    assert api.post("/api/v1/nodes", json=body).status_code == 201
    node = api.get("/api/v1/nodes/login1").json()
    assert [i["name"] for i in node["interfaces"]] == ["eth0", "ib0"]
    assert node["effective"]["wlm_role"] == "compute"
    assert api.get("/api/v1/nodes/nope").status_code == 404


def test_filters_and_pagination(api: Any) -> None:
    assert add(api, nodes="gpu[001-120]", category="gpu").status_code == 201
    assert add(api, nodes="cpu[1-5]").status_code == 201
    page = api.get("/api/v1/nodes", params={"category": "gpu", "limit": 50, "offset": 100}).json()
    assert page["total"] == 120 and len(page["items"]) == 20 and page["items"][0]["name"] == "gpu101"
    sel = api.get("/api/v1/nodes", params={"nodes": "gpu[010-012],cpu3"}).json()
    assert [n["name"] for n in sel["items"]] == ["cpu3", "gpu010", "gpu011", "gpu012"]
    assert api.get("/api/v1/nodes", params={"state": "ready"}).json()["total"] == 0
    assert api.get("/api/v1/nodes", params={"state": "registered"}).json()["total"] == 125
    big = api.get("/api/v1/nodes", params={"nodes": "gpu[001-120]", "limit": 1}).json()
    assert big["total"] == 120


def test_effective_settings_follow_category(api: Any) -> None:
    assert (
        api.post(
            "/api/v1/categories", json={"name": "h100", "boot_mode": "uefi", "kernel_args": "quiet"}
        ).status_code
        == 201
    )
    add(api, nodes="h[1-2]", category="h100")
    assert api.patch("/api/v1/nodes/h2", json={"boot_mode": "bios"}).status_code == 200
    h1, h2 = (api.get(f"/api/v1/nodes/{n}").json()["effective"] for n in ("h1", "h2"))
    assert h1["boot_mode"] == "uefi" and h2["boot_mode"] == "bios" and h2["kernel_args"] == "quiet"
    # an image is a reference: a name that no ready image has is refused, naming the field
    r = api.patch("/api/v1/nodes/h2", json={"image": "rocky9"})
    assert r.status_code == 422 and r.json()["field"] == "image" and "rocky9" in r.json()["message"]
    r = api.post("/api/v1/categories", json={"name": "h200", "image": "ubuntu22-cuda12"})
    assert r.status_code == 422 and r.json()["field"] == "image"
    cats = {c["name"]: c for c in api.get("/api/v1/categories").json()}
    assert cats["h100"]["node_count"] == 2
    # a category in use cannot be removed; an unused one can
    assert api.delete("/api/v1/categories/h100").status_code == 409
    assert api.delete("/api/v1/categories/default").status_code == 200


def test_update_and_delete(api: Any) -> None:
    add(api, nodes="n[1-3]", mac="52:54:00:00:20:01")
    r = api.patch("/api/v1/nodes/n1", json={"interfaces": [{"mac": "52:54:00:00:20:09", "ip": "198.18.2.1"}]})
    assert r.status_code == 200 and r.json()["interfaces"][0]["mac"] == "52:54:00:00:20:09"
    # the freed MAC may be reused
    assert api.post("/api/v1/nodes", json={"name": "n9", "mac": "52:54:00:00:20:01"}).status_code == 201
    assert api.delete("/api/v1/nodes", params={"nodes": "n[2-3]"}).json()["deleted"] == ["n2", "n3"]
    assert api.get("/api/v1/nodes").json()["total"] == 2
    events = api.get("/api/v1/events").json()
    assert {"node.create", "node.update", "node.delete"} <= {e["action"] for e in events}
    assert all(e["actor"] == "admin:bootstrap-admin" for e in events)


def test_openapi_and_healthz_are_served(api: Any) -> None:
    spec = api.get("/openapi.json").json()  # with a token, like the API it describes
    api.headers.pop("Authorization")
    assert api.get("/healthz").json()["status"] == "ok"
    assert "/api/v1/nodes/bulk" in spec["paths"]
