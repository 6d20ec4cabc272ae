"""One reading of every request body (#26): JSON is UTF-8 without a byte-order mark, NUL is refused
everywhere, a stalled body is a 408; and the edges around the API: the OpenAPI document needs a token,
the brake spares valid tokens, forwarded headers are believed only from configured proxies, bcm.db is 0600.
"""

from __future__ import annotations

import asyncio
import json
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from sqlalchemy.engine import Engine

from bcm.api.boot.agent import capped_body
from bcm.api.limits import BodyLimits, has_escaped_nul
from bcm.server import forwarding
from bcm.settings import Settings
from tests.api.test_health_api import REPORT_URL, add_nodes, node_token, report
from tests.api.test_pxe_api import FACTS, MAC
from tests.api.test_security import as_role, snapshot

# every way Python's json module would have read a body that is not plain UTF-8
ENCODINGS = {
    "utf-8-bom": lambda t: b"\xef\xbb\xbf" + t.encode(),
    "utf-16-le": lambda t: t.encode("utf-16-le"),
    "utf-16-be": lambda t: t.encode("utf-16-be"),
    "utf-16-le-bom": lambda t: b"\xff\xfe" + t.encode("utf-16-le"),
    "utf-16-be-bom": lambda t: b"\xfe\xff" + t.encode("utf-16-be"),
    "utf-32-le": lambda t: t.encode("utf-32-le"),
    "utf-32-be": lambda t: t.encode("utf-32-be"),
    "utf-32-le-bom": lambda t: b"\xff\xfe\x00\x00" + t.encode("utf-32-le"),
    "utf-32-be-bom": lambda t: b"\x00\x00\xfe\xff" + t.encode("utf-32-be"),
    "latin-1": lambda t: t.encode("latin-1", "replace"),
}
JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_encoded_bodies_are_refused_on_the_api_and_the_boot_routes(
    api: Any, engine: Engine, encoding: str
) -> None:
    add_nodes(api, engine, "gpu01")
    tok = node_token(api, "gpu01")
    before = snapshot(engine)
    encode = ENCODINGS[encoding]
    cases = [
        ("/api/v1/nodes", {"name": "z1", "comment": "line\nbreak\u00e9"}, {}),
        ("/boot/v1/discover", {"mac": MAC, "facts": FACTS, "x": "\u00e9"}, {"Authorization": ""}),
        (REPORT_URL, {**report("gpu01"), "agent_version": "\u00e9"}, {"Authorization": f"Bearer {tok}"}),
    ]
    for path, body, headers in cases:
        r = api.post(path, content=encode(json.dumps(body, ensure_ascii=False)), headers={**JSON, **headers})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["field"] == "body", r.json()
    assert snapshot(engine) == before


def test_no_content_type_is_read_as_json_too(api: Any, engine: Engine) -> None:
    before = snapshot(engine)
    body = b"\xef\xbb\xbf" + json.dumps({"name": "z1"}).encode()
    r = api.post("/api/v1/nodes", content=body, headers={"Content-Type": ""})
    assert r.status_code == 400 and r.json()["field"] == "body", r.text
    assert snapshot(engine) == before


def test_nul_is_refused_everywhere_naming_the_field(api: Any, engine: Engine) -> None:
    add_nodes(api, engine, "gpu01")
    tok = node_token(api, "gpu01")
    rep = report("gpu01")
    rep["gpus"][0]["uuid"] = "GPU-\u0000x"
    facts = json.loads(json.dumps(FACTS))
    facts["nics"][0]["name"] = "eth\u00000"
    before = snapshot(engine)
    cases = [
        ("/api/v1/nodes", {"name": "z1", "comment": "a\u0000b"}, {}, "comment"),
        ("/boot/v1/discover", {"mac": MAC, "facts": facts}, {"Authorization": ""}, "facts.nics.0.name"),
        (
            "/boot/v1/hello",
            {"mac": MAC, "host_key": "ssh-ed25519 \u0000"},
            {"Authorization": "Bearer x"},
            "host_key",
        ),
        (REPORT_URL, rep, {"Authorization": f"Bearer {tok}"}, "gpus.0.uuid"),
    ]
    for path, body, headers, field in cases:
        r = api.post(path, content=json.dumps(body).encode(), headers={**JSON, **headers})
        assert r.status_code == 422, (path, r.text)
        assert r.json()["field"] == field, r.json()
    assert snapshot(engine) == before
    # the text "\u0000" (an escaped backslash, then u0000) is no NUL and is stored as sent
    r = api.post("/api/v1/nodes", json={"name": "z1", "comment": "\\u0000"})
    assert r.status_code == 201 and r.json()["comment"] == "\\u0000", r.text
    # a wrong token is still a 401 before the body's faults are told (the report route checks it first)
    r = api.post(
        REPORT_URL, content=json.dumps(rep).encode(), headers={**JSON, "Authorization": "Bearer bcm_x"}
    )
    assert r.status_code == 401


@pytest.mark.parametrize(
    ("text", "nul"),
    [
        ('"a"', False),
        ('"\\u0000"', True),
        ('"\\\\u0000"', False),
        ('"\\\\\\u0000"', True),
        ('"\\\\\\\\u0000"', False),
    ],
)
def test_escaped_nul_is_told_from_an_escaped_backslash(text: str, nul: bool) -> None:
    assert has_escaped_nul(text.encode()) is nul
    assert ("\x00" in json.loads(text)) is nul


# --- a stalled body -----------------------------------------------------------------------------------


def _stalling_receive() -> Any:
    """An ASGI receive that gives the first part of a body and then nothing, ever."""
    parts = [{"type": "http.request", "body": b'{"name": ', "more_body": True}]

    async def receive() -> dict[str, Any]:
        if parts:
            return parts.pop()
        await asyncio.Event().wait()  # the client never sends the rest
        raise AssertionError("unreachable")

    return receive


def test_a_stalled_body_is_a_408_in_the_middleware() -> None:
    reached: list[bool] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(True)

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    limits = BodyLimits(app, max_body_bytes=1 << 20, max_json_depth=32, body_timeout_s=0.05)
    scope = {"type": "http", "method": "POST", "path": "/api/v1/nodes", "headers": []}
    asyncio.run(asyncio.wait_for(limits(scope, _stalling_receive(), send), 10))
    assert not reached
    assert sent[0]["status"] == 408 and (b"connection", b"close") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["field"] == "body"


def test_a_stalled_report_body_is_a_408_in_the_report_route() -> None:
    from bcm.api.limits import RequestTimeout

    scope = {"type": "http", "method": "POST", "path": REPORT_URL, "headers": []}
    request = Request(scope, _stalling_receive())
    with pytest.raises(RequestTimeout):
        asyncio.run(asyncio.wait_for(capped_body(request, 0.05), 10))


# --- the OpenAPI document, the brake, forwarded headers, the database file ------------------------------


def test_openapi_and_docs_need_a_viewer_token(api: Any) -> None:
    for path in ("/openapi.json", "/docs"):
        assert api.get(path, headers={"Authorization": ""}).status_code == 401
        assert api.get(path, headers=as_role(api, "viewer")).status_code == 200
    assert api.get("/redoc", headers={"Authorization": ""}).status_code in (401, 404)
    assert "/api/v1/nodes" in api.get("/openapi.json").json()["paths"]


def test_the_sqlite_database_and_its_journal_are_private(engine: Engine, settings: Any) -> None:
    if engine.dialect.name != "sqlite":
        pytest.skip("a file only on SQLite")
    with engine.begin() as conn:  # a write: the -wal and -shm files exist
        conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS t_mode (x int)")
    path = Path(engine.url.database or "")
    files = [path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")]
    assert all(f.exists() for f in files)
    assert {oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {oct(0o600)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _client_seen(settings: Settings, forwarded_for: str) -> str:
    """The client address a real uvicorn (configured as ``bcm serve`` configures it) gives the app."""
    app = FastAPI()

    @app.get("/who")
    def who(request: Request) -> str:
        return request.client.host if request.client else ""

    proxy_headers, trusted = forwarding(settings)
    port = _free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="off",
        proxy_headers=proxy_headers,
        forwarded_allow_ips=trusted,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        r = httpx.get(f"http://127.0.0.1:{port}/who", headers={"X-Forwarded-For": forwarded_for}, timeout=5)
        return str(r.json())
    finally:
        server.should_exit = True
        thread.join(10)


def test_forwarded_headers_are_believed_only_from_configured_proxies() -> None:
    assert forwarding(Settings()) == (False, None)
    assert _client_seen(Settings(), "203.0.113.7") == "127.0.0.1"
    trusting = Settings.model_validate({"http": {"trusted_proxies": "127.0.0.1, 10.0.0.0/8"}})
    assert forwarding(trusting) == (True, ["127.0.0.1", "10.0.0.0/8"])
    assert _client_seen(trusting, "203.0.113.7") == "203.0.113.7"
    with pytest.raises(ValueError):
        Settings.model_validate({"http": {"trusted_proxies": "10.0.0.1\nX"}})
