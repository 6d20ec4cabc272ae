"""Every string a client puts in a path or a query string is bounded before it reaches a query.

A parameter without a pattern lets a NUL byte through to the database (PostgreSQL refuses it with an
error the client sees as a 500) and lets any length through to a column; this walks the app's
schema so a new route that forgets its bounds fails here, and asks the routes that once did.
"""

from __future__ import annotations

from typing import Any

import pytest


def _string_schemas(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The string alternatives of a parameter's schema (``str | None`` is an anyOf with null)."""
    options = schema.get("anyOf", [schema])
    return [s for s in options if s.get("type") == "string"]


def unbounded(spec: dict[str, Any]) -> list[str]:
    found = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            for p in op.get("parameters", []):
                if p["in"] not in ("path", "query"):
                    continue
                for s in _string_schemas(p["schema"]):
                    if "enum" in s or "format" in s:
                        continue
                    if "pattern" not in s or "maxLength" not in s:
                        found.append(f"{method.upper()} {path} {p['in']}:{p['name']}")
    return found


def test_every_string_parameter_has_a_pattern_and_a_length(api: Any) -> None:
    spec = api.get("/openapi.json").json()
    assert unbounded(spec) == []


def test_the_walk_sees_an_unbounded_parameter() -> None:
    spec = {
        "paths": {
            "/x/{name}": {
                "get": {
                    "parameters": [
                        {"in": "path", "name": "name", "schema": {"type": "string"}},
                        {
                            "in": "query",
                            "name": "q",
                            "schema": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
                        },
                        {
                            "in": "query",
                            "name": "ok",
                            "schema": {"type": "string", "pattern": "^a$", "maxLength": 1},
                        },
                    ]
                }
            }
        }
    }
    assert unbounded(spec) == ["GET /x/{name} path:name", "GET /x/{name} query:q"]


@pytest.mark.parametrize(
    "url",
    [
        "/api/v1/projects?department=a%00b",
        "/api/v1/projects/a%00b",
        "/api/v1/departments/a%00b",
        "/api/v1/projects/a%00b/members",
        "/api/v1/wlm/a%00b",
        "/api/v1/projects?department=" + "a" * 100,
    ],
)
def test_a_nul_or_an_overlong_name_is_a_422_naming_the_field(api: Any, url: str) -> None:
    r = api.get(url)
    assert r.status_code == 422, (url, r.status_code, r.text)
    assert r.json()["field"] in ("department", "name")
