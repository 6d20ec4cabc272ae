"""Every route that takes a JSON body, fuzzed with that body in UTF-8 with and without a byte-order mark,
UTF-16 and UTF-32 in both byte orders (with and without a mark), carrying control characters or deep
nesting (#26): each answer is a 4xx, and not one row of any table changes.

The routes are enumerated from the app itself, so a route added later is fuzzed without a change here.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.routing import APIRoute
from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine

from tests.api.test_health_api import REPORT_URL, add_nodes, node_token, post, report

ENCODINGS = {
    "utf-8": lambda t: t.encode(),
    "utf-8-bom": lambda t: b"\xef\xbb\xbf" + t.encode(),
    "utf-16-le": lambda t: t.encode("utf-16-le"),
    "utf-16-be": lambda t: t.encode("utf-16-be"),
    "utf-16-le-bom": lambda t: b"\xff\xfe" + t.encode("utf-16-le"),
    "utf-16-be-bom": lambda t: b"\xfe\xff" + t.encode("utf-16-be"),
    "utf-32-le": lambda t: t.encode("utf-32-le"),
    "utf-32-be": lambda t: t.encode("utf-32-be"),
    "utf-32-le-bom": lambda t: b"\xff\xfe\x00\x00" + t.encode("utf-32-le"),
    "utf-32-be-bom": lambda t: b"\x00\x00\xfe\xff" + t.encode("utf-32-be"),
}
EVIL = "gpu01\u0000\n\x1b[31m\u009b"  # NUL, a newline, an ANSI escape, CSI
FIELDS = (
    "name",
    "nodes",
    "comment",
    "description",
    "mac",
    "host_key",
    "recipe",
    "user",
    "role",
    "password",
    "department",
    "category",
    "ssh_host_key",
    "kernel_args",
    "hostname",
    "agent_version",
)
BODIES = {
    "control": {field: EVIL for field in FIELDS} | {"facts": {"nics": [{"name": EVIL}]}},
    "deep": {"name": "z1", "nodes": "z1", "facts": json.loads("[" * 40 + "]" * 40)},
}


def api_routes(routes: list[Any], prefix: str = "") -> list[tuple[str, APIRoute]]:
    """Every route of the app with its full path, through included routers."""
    found: list[tuple[str, APIRoute]] = []
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            found += api_routes(included.routes, prefix + route.include_context.prefix)
        elif isinstance(route, APIRoute):
            found.append((prefix + route.path, route))
    return found


def json_routes(app: Any) -> list[tuple[str, str]]:
    """(method, path) of every route that takes a body: those FastAPI parses as JSON (a body field) and
    those that read it themselves (discovery, agent reports), path parameters filled in."""
    found = []
    for path, route in api_routes(app.routes):
        for param in route.param_convertors:
            path = path.replace("{" + param + "}", "keep1")
        found += [(method, path) for method in sorted(route.methods - {"GET", "HEAD"})]
    return found


def every_row(engine: Engine) -> dict[str, list[str]]:
    tables = [t for t in inspect(engine).get_table_names() if t != "alembic_version"]
    with engine.connect() as conn:
        return {t: sorted(map(repr, conn.execute(text(f'SELECT * FROM "{t}"')))) for t in tables}


def test_every_json_route_refuses_every_encoding_and_stores_nothing(api: Any, engine: Engine) -> None:
    routes = json_routes(api.app)
    paths = {p for _, p in routes}
    # the enumeration found the admin API and the node-facing routes alike
    assert {"/api/v1/nodes", "/boot/v1/discover", "/boot/v1/hello", "/boot/v1/agent/report"} <= paths
    assert len(routes) >= 30
    add_nodes(api, engine, "keep1")
    node = {"Authorization": f"Bearer {node_token(api, 'keep1')}"}  # the report route's own kind of token
    api.get("/api/v1/nodes")  # the token's last use is written before the snapshot, not during it
    post(api, node["Authorization"].split()[1], report("keep1"))
    before = every_row(engine)
    for method, path in routes:
        headers = {"Content-Type": "application/json", **(node if path == REPORT_URL else {})}
        for body_name, body in BODIES.items():
            text_body = json.dumps(body, ensure_ascii=False)
            for encoding, encode in ENCODINGS.items():
                r = api.request(method, path, content=encode(text_body), headers=headers)
                case = (method, path, body_name, encoding, r.status_code, r.text)
                # refused for its encoding or depth (400 naming the body), else for its characters (422
                # naming the field): never read by a route as JSON
                if encoding != "utf-8":
                    assert r.status_code == 400 and r.json()["field"] == "body", case
                elif body_name == "deep" and path == REPORT_URL:  # nesting bounded by pydantic's own parser
                    assert r.status_code == 422, case
                elif body_name == "deep":
                    assert r.status_code == 400 and r.json()["field"] == "body", case
                else:
                    assert r.status_code == 422 and r.json()["field"] == "name", case
    assert every_row(engine) == before
