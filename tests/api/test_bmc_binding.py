"""BMC passwords go only to the BMC they were set for (#26): an operator who points a node's BMC at a host
of their own gets nothing sent there, by a power operation or by the background poll.

The real BMCs are the emulators of ``bmcs`` (ipmi_sim, sushy-tools over https); the attacker's end is a
listener on loopback that records every packet or request it gets and answers like a Redfish service,
so that a client that trusted it would go on to send its Basic credentials.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import json
import socket
import ssl
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from bcm.lab import bmc
from bcm.workers import power as worker
from tests.api.test_power_api import PASSWORD, fast_power, free_port, make_token, power, register, wait_op

__all__ = ["fast_power"]  # a fixture

SERVICE_ROOT = {
    "@odata.id": "/redfish/v1/",
    "@odata.type": "#ServiceRoot.v1_0_0.ServiceRoot",
    "Id": "RootService",
    "Name": "Root Service",
    "RedfishVersion": "1.0.0",
    "UUID": "85775665-c110-4b85-8989-e6162170b3ec",
    "Systems": {"@odata.id": "/redfish/v1/Systems"},
}


class Listener:
    """The attacker's end on 127.0.0.1: counts contacts, keeps what arrives (decrypted, for https)."""

    def __init__(self, kind: str, directory: Path, port: int = 0) -> None:
        self.kind = kind
        self.contacts = 0
        self.received: list[bytes] = []
        self._stop = threading.Event()
        if kind == "udp":
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self._sock.bind(("127.0.0.1", port))
            self._sock.settimeout(0.1)
            self._thread = threading.Thread(target=self._udp)
        else:
            listener = self

            class Handler(http.server.BaseHTTPRequestHandler):
                def do_GET(self) -> None:  # noqa: N802 - http.server's name
                    listener.contacts += 1
                    listener.received.append(f"{self.requestline}\n{self.headers}".encode())
                    if self.path.rstrip("/") == "/redfish/v1":
                        body, status = json.dumps(SERVICE_ROOT).encode(), 200
                    else:
                        body, status = b'{"error": {"code": "Base.1.0.GeneralError", "message": "no"}}', 401
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

                def log_message(self, *args: Any) -> None:
                    pass

            self._http = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
            if kind == "https":  # the attacker's own certificate, not the BMC's
                directory.mkdir(parents=True, exist_ok=True)
                bmc.make_certificate(directory, "127.0.0.1")
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                context.load_cert_chain(directory / "tls.crt", directory / "tls.key")
                self._http.socket = context.wrap_socket(self._http.socket, server_side=True)
            self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.1})
        self._thread.start()

    @property
    def port(self) -> int:
        sock = self._sock if self.kind == "udp" else self._http.socket
        return int(sock.getsockname()[1])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}" if self.kind == "udp" else f"{self.kind}://127.0.0.1:{self.port}"

    def got_password(self) -> bool:
        basic = base64.b64encode(f"admin:{PASSWORD}".encode())
        return any(PASSWORD.encode() in data or basic in data for data in self.received)

    def _udp(self) -> None:
        while not self._stop.is_set():
            try:
                data, _ = self._sock.recvfrom(65536)
            except TimeoutError:
                continue
            self.contacts += 1
            self.received.append(data)

    def close(self) -> None:
        self._stop.set()
        if self.kind == "udp":
            self._thread.join()
            self._sock.close()
        else:
            self._http.shutdown()
            self._thread.join()
            self._http.server_close()


@pytest.fixture
def listeners(tmp_path: Path) -> Iterator[dict[str, Listener]]:
    made = {kind: Listener(kind, tmp_path / f"attacker-{kind}") for kind in ("udp", "http", "https")}
    try:
        yield made
    finally:
        for listener in made.values():
            listener.close()


def status_as(api: Any, token: str, nodes: str) -> dict[str, Any]:
    r = power(api, "status", nodes, Authorization=f"Bearer {token}")
    assert r.status_code == 200, r.text
    return wait_op(api, r.json()["operation_id"])


def poll(engine: Any, settings: Any) -> None:
    """One round of the background power poll, driven by the test (no clock)."""
    asyncio.run(worker.poll_once(engine, settings))


def test_an_operator_cannot_send_a_nodes_password_to_a_host_of_their_own(
    api: Any,
    engine: Any,
    settings: Any,
    bmcs: dict[str, bmc.BmcSpec],
    listeners: dict[str, Listener],
    fast_power: Any,
) -> None:
    register(api, "v1", bmcs["redfish"])
    register(api, "v2", bmcs["ipmi"])
    assert api.put("/api/v1/nodes/bmc-password", json={"nodes": "v[1-2]", "password": PASSWORD}).json() == {
        "updated": 2
    }
    operator = make_token(api, "operator")
    op = status_as(api, operator, "v[1-2]")
    assert {n: r["status"] for n, r in op["results"].items()} == {"v1": "ok", "v2": "ok"}, op

    bound = {
        "v1": f"redfish+https://127.0.0.1:{bmcs['redfish'].port}",
        "v2": f"ipmi://127.0.0.1:{bmcs['ipmi'].port}",
    }
    moves = [  # each: what the operator changes on which node; a listener would get the password
        ("v1", {"bmc_address": listeners["http"].address}),
        ("v1", {"bmc_address": listeners["https"].address}),
        ("v1", {"bmc_address": f"http://127.0.0.1:{bmcs['redfish'].port}"}),  # the scheme only
        ("v2", {"bmc_address": listeners["udp"].address}),  # the port only
        ("v2", {"bmc_address": listeners["http"].address, "bmc_protocol": "redfish"}),
    ]
    for name, change in moves:
        r = api.patch(f"/api/v1/nodes/{name}", json=change, headers={"Authorization": f"Bearer {operator}"})
        assert r.status_code == 200, r.text
        op = status_as(api, operator, name)
        result = op["results"][name]
        assert result["status"] == "no_bmc", (change, result)
        assert "an admin must set them again" in result["message"]
        assert f"bcm power set {name} --password-stdin" in result["message"]
        assert f"were set for {bound[name]}; its BMC is now " in result["message"]
        poll(engine, settings)
    for listener in listeners.values():
        assert listener.contacts == 0 and not listener.got_password(), listener.kind

    # back at the BMC the password was set for, it works again; nothing secret was shown on the way
    for name, spec in (("v1", bmcs["redfish"]), ("v2", bmcs["ipmi"])):
        body = {"bmc_address": spec.address, "bmc_protocol": spec.kind}
        assert (
            api.patch(
                f"/api/v1/nodes/{name}", json=body, headers={"Authorization": f"Bearer {operator}"}
            ).status_code
            == 200
        )
    op = status_as(api, operator, "v[1-2]")
    assert {n: r["status"] for n, r in op["results"].items()} == {"v1": "ok", "v2": "ok"}, op
    assert PASSWORD not in api.get("/api/v1/events").text
    assert all(PASSWORD not in api.get(f"/api/v1/operations/{i}").text for i in range(1, op["id"] + 1))


def test_what_viewers_read_does_not_tell_open_from_closed_ports(
    api: Any, bmcs: dict[str, bmc.BmcSpec], listeners: dict[str, Listener], fast_power: Any
) -> None:
    """Moved to a closed port, an http or https server, or a UDP service: the same answer, nothing contacted."""
    register(api, "v1", bmcs["redfish"])
    api.put("/api/v1/nodes/bmc-password", json={"nodes": "v1", "password": PASSWORD})
    operator, viewer = make_token(api, "operator"), make_token(api, "viewer")
    closed = free_port(socket.SOCK_STREAM)
    seen = set()
    for address, protocol in [
        (f"https://127.0.0.1:{closed}", "redfish"),
        (listeners["http"].address, "redfish"),
        (listeners["https"].address, "redfish"),
        (listeners["udp"].address, "ipmi"),
        (f"127.0.0.1:{closed}", "ipmi"),
    ]:
        body = {"bmc_address": address, "bmc_protocol": protocol}
        assert (
            api.patch(
                "/api/v1/nodes/v1", json=body, headers={"Authorization": f"Bearer {operator}"}
            ).status_code
            == 200
        )
        op_id = power(api, "status", "v1", Authorization=f"Bearer {operator}").json()["operation_id"]
        wait_op(api, op_id)
        op = api.get(f"/api/v1/operations/{op_id}", headers={"Authorization": f"Bearer {viewer}"}).json()
        result = op["results"]["v1"]
        port = address.rsplit(":", 1)[1]
        seen.add(
            (
                result["status"],
                result["message"]
                .replace(port, "PORT")
                .replace("redfish+https", "SCHEME")
                .replace("redfish+http", "SCHEME")
                .replace("ipmi", "SCHEME"),
            )
        )
    assert len(seen) == 1 and next(iter(seen))[0] == "no_bmc", seen
    assert all(listener.contacts == 0 for listener in listeners.values())


def test_a_category_password_goes_only_to_the_bmcs_its_nodes_had_when_an_admin_set_it(
    api: Any,
    engine: Any,
    settings: Any,
    bmcs: dict[str, bmc.BmcSpec],
    listeners: dict[str, Listener],
    fast_power: Any,
) -> None:
    body = {"name": "rack1", "bmc_protocol": "redfish", "bmc_user": "admin"}
    assert api.post("/api/v1/categories", json=body).status_code == 201
    assert (
        api.post(
            "/api/v1/nodes", json={"name": "c1", "category": "rack1", "bmc_address": bmcs["redfish"].address}
        ).status_code
        == 201
    )
    assert api.put("/api/v1/categories/rack1/bmc-password", json={"password": PASSWORD}).status_code == 200
    operator = make_token(api, "operator")
    as_operator = {"Authorization": f"Bearer {operator}"}
    assert status_as(api, operator, "c1")["results"]["c1"]["status"] == "ok"

    # a node the operator adds to the category, or moves into it, with an address of their choice
    new = {"name": "c2", "category": "rack1", "bmc_address": listeners["https"].address}
    assert api.post("/api/v1/nodes", json=new, headers=as_operator).status_code == 201
    assert (
        api.post(
            "/api/v1/nodes",
            json={"name": "c3", "bmc_address": listeners["http"].address},
            headers=as_operator,
        ).status_code
        == 201
    )
    assert api.patch("/api/v1/nodes/c3", json={"category": "rack1"}, headers=as_operator).status_code == 200
    # and a member whose BMC the operator moves
    assert (
        api.patch(
            "/api/v1/nodes/c1", json={"bmc_address": listeners["https"].address}, headers=as_operator
        ).status_code
        == 200
    )
    results = status_as(api, operator, "c[1-3]")["results"]
    assert {n: r["status"] for n, r in results.items()} == {"c1": "no_bmc", "c2": "no_bmc", "c3": "no_bmc"}
    assert "(from category rack1) were not set for it" in results["c2"]["message"]
    assert "(from category rack1) were set for redfish+https://127.0.0.1:" in results["c1"]["message"]
    assert all(
        "an admin must set them again (bcm power set-category rack1 --password-stdin" in r["message"]
        for r in results.values()
    )
    poll(engine, settings)
    for listener in listeners.values():
        assert listener.contacts == 0 and not listener.got_password(), listener.kind

    # an operator cannot re-bind: setting passwords stays admin only
    r = api.put("/api/v1/categories/rack1/bmc-password", json={"password": PASSWORD}, headers=as_operator)
    assert r.status_code == 403

    # an admin who sets it again binds it to the BMCs the members have now; c1's BMC moved: its pin goes
    def pins() -> dict[str, str | None]:
        with engine.connect() as conn:
            return {n: p for n, p in conn.execute(text("SELECT name, bmc_tls_pin FROM node"))}

    assert pins()["c1"] is not None
    assert api.put("/api/v1/categories/rack1/bmc-password", json={"password": PASSWORD}).status_code == 200
    assert pins() == {"c1": None, "c2": None, "c3": None}
    results = status_as(api, operator, "c[1-3]")["results"]
    assert {n: r["status"] for n, r in results.items()} == {
        "c1": "auth_failed",
        "c2": "auth_failed",
        "c3": "no_bmc",
    }
    assert "plain http" in results["c3"]["message"]  # rack1 does not allow http
    assert listeners["https"].got_password()  # where the admin said it may go


def test_plain_http_needs_an_admins_permission_for_the_category(
    api: Any, engine: Any, settings: Any, listeners: dict[str, Listener], fast_power: Any
) -> None:
    http_bmc = listeners["http"]  # stands in for a BMC that only speaks http
    assert (
        api.post(
            "/api/v1/categories", json={"name": "old", "bmc_protocol": "redfish", "bmc_user": "admin"}
        ).status_code
        == 201
    )
    assert (
        api.post(
            "/api/v1/nodes", json={"name": "h1", "category": "old", "bmc_address": http_bmc.address}
        ).status_code
        == 201
    )
    assert (
        api.put("/api/v1/nodes/bmc-password", json={"nodes": "h1", "password": PASSWORD}).status_code == 200
    )
    operator = make_token(api, "operator")
    as_operator = {"Authorization": f"Bearer {operator}"}

    result = status_as(api, operator, "h1")["results"]["h1"]
    assert result["status"] == "no_bmc" and "plain http" in result["message"]
    assert "bcm power set-category old --allow-http" in result["message"]
    poll(engine, settings)
    assert http_bmc.contacts == 0

    # only an admin allows it: an operator's PATCH of the category does not, nor the admin route
    api.patch("/api/v1/categories/old", json={"bmc_allow_http": True}, headers=as_operator)
    assert api.get("/api/v1/categories/old").json()["bmc_allow_http"] is False
    r = api.put("/api/v1/categories/old/bmc-allow-http", json={"allow": True}, headers=as_operator)
    assert r.status_code == 403
    assert status_as(api, operator, "h1")["results"]["h1"]["status"] == "no_bmc"
    assert http_bmc.contacts == 0
    for bad in ("sometimes", 1, "true", None):
        r = api.put("/api/v1/categories/old/bmc-allow-http", json={"allow": bad})
        assert r.status_code == 422 and "allow" in r.text, (bad, r.text)
    assert api.get("/api/v1/categories/old").json()["bmc_allow_http"] is False

    assert api.put("/api/v1/categories/old/bmc-allow-http", json={"allow": True}).status_code == 200
    assert api.get("/api/v1/categories/old").json()["bmc_allow_http"] is True
    result = status_as(api, operator, "h1")["results"]["h1"]
    assert result["status"] == "auth_failed" and http_bmc.got_password()  # as the admin allowed
    events = api.get("/api/v1/events", params={"action": "category.bmc_allow_http"}).json()
    assert [e["target"] for e in events] == ["old"]


def test_a_changed_bmc_certificate_is_refused_before_anything_is_sent(
    api: Any, engine: Any, settings: Any, fast_power: Any, tmp_path: Path
) -> None:
    spec = bmc.BmcSpec(
        "redfish",
        "m-tls",
        "127.0.0.1",
        free_port(socket.SOCK_STREAM),
        "admin",
        PASSWORD,
        str(tmp_path / "bmc"),
    )
    bmc.write_machine(spec, [sys.executable, "-c", "import time; time.sleep(3600)", "machine-{boot}"])
    proc = bmc.start(spec)
    try:
        _pinned_then_impostor(api, engine, settings, spec, proc.pid, tmp_path)
    finally:
        bmc.stop(proc.pid, spec.dir)
    proc = bmc.start(spec)  # the BMC is back, with its own certificate
    try:
        _back_and_unpinned(api, engine, settings, spec)
    finally:
        bmc.stop(proc.pid, spec.dir)


def _pinned_then_impostor(
    api: Any, engine: Any, settings: Any, spec: bmc.BmcSpec, pid: int, tmp_path: Path
) -> None:
    register(api, "t1", spec)
    api.put("/api/v1/nodes/bmc-password", json={"nodes": "t1", "password": PASSWORD})
    assert wait_op(api, power(api, "status", "t1").json()["operation_id"])["results"]["t1"]["status"] == "ok"
    pin = bmc.certificate_sha256(spec.dir / "tls.crt")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT bmc_tls_pin FROM node WHERE name = 't1'")).scalar() == pin

    # another machine takes over the BMC's address and port, with a certificate of its own
    bmc.stop(pid)
    impostor = Listener("https", tmp_path / "impostor", port=spec.port)
    try:
        op = wait_op(api, power(api, "on", "t1").json()["operation_id"])
        result = op["results"]["t1"]
        assert result["status"] == "tls_changed" and result["attempts"] == 1, result
        assert "not the one pinned" in result["message"] and "bcm power unpin t1" in result["message"]
        poll(engine, settings)
        assert impostor.contacts == 0 and not impostor.got_password()
        events = api.get("/api/v1/events", params={"action": "node.bmc_tls_changed"}).json()
        assert events and events[0]["target"] == "t1" and events[0]["severity"] == "warning"
        operator = make_token(api, "operator")
        r = api.post(
            "/api/v1/nodes/bmc-unpin", json={"nodes": "t1"}, headers={"Authorization": f"Bearer {operator}"}
        )
        assert r.status_code == 403
    finally:
        impostor.close()


def _back_and_unpinned(api: Any, engine: Any, settings: Any, spec: bmc.BmcSpec) -> None:
    """The BMC's own certificate still fits its pin; an admin's unpin lets the next contact pin anew."""
    pin = bmc.certificate_sha256(spec.dir / "tls.crt")
    assert wait_op(api, power(api, "status", "t1").json()["operation_id"])["results"]["t1"]["status"] == "ok"
    assert api.post("/api/v1/nodes/bmc-unpin", json={"nodes": "t1"}).json() == {"updated": 1}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT bmc_tls_pin FROM node WHERE name = 't1'")).scalar() is None
    poll(engine, settings)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT bmc_tls_pin FROM node WHERE name = 't1'")).scalar() == pin
