"""A stepped hostlist range that ClusterShell cannot expand is a 422 naming the field on every route that
takes a hostlist, viewer reads included, on SQLite and PostgreSQL (it was a 500: an AssertionError)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

STEPPED = "a[0-999999999/999999999]"


@pytest.mark.parametrize(
    ("method", "path", "body", "params"),
    [
        ("GET", "/api/v1/nodes", None, {"nodes": STEPPED}),
        ("GET", "/api/v1/health/nodes", None, {"nodes": STEPPED}),
        ("POST", "/api/v1/nodes/bulk", {"nodes": STEPPED}, None),
        ("POST", "/api/v1/nodes/actions/power-on", {"nodes": STEPPED}, None),
        (
            "POST",
            "/api/v1/categories",
            {"name": "dgx", "discover_mac_prefix": "52:54:00", "discover_names": STEPPED},
            None,
        ),
    ],
)
def test_a_stepped_range_is_a_422_naming_the_field(
    api: TestClient, method: str, path: str, body: Any, params: Any
) -> None:
    r = api.request(method, path, json=body, params=params)
    assert r.status_code == 422, r.text
    assert r.json()["field"] in {"nodes", "discover_names"}
    assert "spans" in r.json()["message"]
