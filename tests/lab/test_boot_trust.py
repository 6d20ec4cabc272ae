"""Boot trust (#26 item 2) against a real dnsmasq that `bcm serve` supervises, in DHCP and in proxy mode:
two client namespaces on an isolated bridge (198.18.226.0/24, no route out), the node's with the node's
MAC and a second one with another MAC. In DHCP mode both get real leases from bcm's dnsmasq (busybox
udhcpc, the initramfs's own hook); in proxy mode their addresses come from elsewhere (static here). The
second address fetches the node's script, and tries the node's token at overlay and hello: refused.

The image served is published by the images service from small files (as tests/api/test_pxe_api.py does;
the real build and VM boots are in tests/lab/test_zero_touch.py); the node's BMC is a real ipmi_sim on loopback.
"""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bcm.db import make_engine
from bcm.devserver import REPO, Server
from bcm.lab import net
from bcm.settings import Settings
from tests.api.test_power_api import PASSWORD, bmcs  # noqa: F401 - fixture
from tests.api.test_pxe_api import publish_image

pytestmark = pytest.mark.lab

BRIDGE_NS, HOST_IF = "bt26lab", "bt26-prov"
SUBNET = ipaddress.ip_network("198.18.226.0/24")
HEAD = "198.18.226.1"
NODE_MAC, OTHER_MAC = "52:54:00:26:00:01", "52:54:00:26:00:02"
NODE_NS, OTHER_NS = "bt26n1", "bt26n2"
STATIC = {NODE_NS: "198.18.226.60", OTHER_NS: "198.18.226.66"}  # proxy mode: another DHCP server's leases
UDHCPC_HOOK = REPO / "templates" / "image" / "udhcpc.script"


@pytest.fixture(scope="module")
def wire(lab_unavailable_reason: None) -> Iterator[None]:
    """The bridge namespace, the head's veth (198.18.226.1) and the two client namespaces."""
    net.keep_lab_space_local()
    _down()
    net.create_network(BRIDGE_NS, HOST_IF, SUBNET)
    net.add_nodes(
        BRIDGE_NS,
        [
            net.NodeLink(NODE_NS, "bt26p1", NODE_MAC, "52:54:00:27:00:01", f"{STATIC[NODE_NS]}/24"),
            net.NodeLink(OTHER_NS, "bt26p2", OTHER_MAC, "52:54:00:27:00:02", f"{STATIC[OTHER_NS]}/24"),
        ],
    )
    try:
        yield
    finally:
        _down()


@pytest.fixture(scope="module")
def lab_unavailable_reason() -> None:
    from tests.lab.conftest import lab_unavailable

    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)


def _down() -> None:
    net.delete_netns([n for n in (NODE_NS, OTHER_NS, BRIDGE_NS) if n in net.netns_names()])
    if net.link_exists(HOST_IF):
        net.delete_link(HOST_IF)


def in_ns(ns: str, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=timeout, check=False
    )


def address_of(ns: str) -> str | None:
    shown = json.loads(in_ns(ns, "ip", "-j", "-4", "addr", "show", "dev", "eth0").stdout or "[]")
    found = [a["local"] for i in shown for a in i.get("addr_info", [])]
    return found[0] if found else None


def lease(ns: str) -> str:
    """A real lease from bcm's dnsmasq, put on eth0 by the initramfs's udhcpc hook."""
    in_ns(ns, "ip", "addr", "flush", "dev", "eth0")
    done = in_ns(
        ns,
        "busybox",
        "udhcpc",
        "-i",
        "eth0",
        "-n",
        "-q",
        "-t",
        "5",
        "-T",
        "2",
        "-s",
        str(UDHCPC_HOOK),
        timeout=60,
    )
    got = address_of(ns)
    assert done.returncode == 0 and got and ipaddress.ip_address(got) in SUBNET, (done.stdout, done.stderr)
    return got


def static(ns: str) -> str:
    in_ns(ns, "ip", "addr", "flush", "dev", "eth0")
    in_ns(ns, "ip", "addr", "add", f"{STATIC[ns]}/24", "dev", "eth0")
    return STATIC[ns]


def curl(ns: str, url: str, *args: str) -> tuple[int, dict[str, str], str]:
    """(status, headers, body) of one request made from inside ``ns``."""
    done = in_ns(ns, "curl", "-sS", "--max-time", "20", "--noproxy", "*", "-D", "-", *args, url)
    assert done.returncode == 0, done.stderr
    head, _, body = done.stdout.replace("\r\n", "\n").partition("\n\n")
    status = int(head.split()[1])
    headers = {
        k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head.splitlines()[1:])
    }
    return status, headers, body


class Head:
    def __init__(self, server: Server, base: str) -> None:
        self.server, self.base = server, base
        self.http = httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {server.token()}"}, timeout=30
        )

    def script(self, ns: str, mac: str = NODE_MAC) -> tuple[str, str]:
        status, headers, body = curl(ns, f"{self.base}/boot/v1/ipxe/{mac}")
        assert status == 200, body
        return headers["x-bcm-purpose"], body

    def overlay(self, ns: str, token: str) -> int:
        return curl(
            ns,
            f"{self.base}/boot/v1/overlay/{NODE_MAC}",
            "-o",
            "/dev/null",
            "-H",
            f"Authorization: Bearer {token}",
        )[0]

    def hello(self, ns: str, token: str) -> tuple[int, str]:
        status, _, body = curl(
            ns,
            f"{self.base}/boot/v1/hello",
            "-H",
            f"Authorization: Bearer {token}",
            "-H",
            "Content-Type: application/json",
            "-H",
            "X-Forwarded-For: 198.18.226.66",
            "--data",
            json.dumps({"mac": NODE_MAC}),
        )
        return status, body


@pytest.fixture
def head(wire: None, tmp_path: Path, bmcs: dict[str, Any], request: pytest.FixtureRequest) -> Iterator[Head]:  # noqa: F811
    """`bcm serve` on 0.0.0.0 with PXE enabled on the lab interface, and gpu01 (the node's MAC, a real
    BMC, an image) put to provisioning by `provision`."""
    server = Server(tmp_path / "state", host="0.0.0.0")
    server.start()
    try:
        mode = request.param
        enable = ["pxe", "enable", "--interface", HOST_IF, "--address", HEAD]
        enable += ["--mode", "proxy"] if mode == "proxy" else ["--range", "198.18.226.100-198.18.226.150"]
        done = server.cli(*enable)
        assert done.returncode == 0, done.stderr
        h = Head(server, f"http://{HEAD}:{server.port}")
        assert h.http.get("/api/v1/pxe").json()["dnsmasq_pid"], "dnsmasq is not running"
        settings = Settings(state_dir=server.state_dir)
        engine = make_engine(settings.effective_database_url, settings.db)
        publish_image(engine, settings)
        engine.dispose()
        spec = bmcs["ipmi"]
        r = h.http.post(
            "/api/v1/nodes",
            json={
                "name": "gpu01",
                "mac": NODE_MAC,
                "image": "img",
                "bmc_address": spec.address,
                "bmc_protocol": spec.kind,
                "bmc_user": "admin",
            },
        )
        assert r.status_code == 201, r.text
        assert h.http.put(
            "/api/v1/nodes/bmc-password", json={"nodes": "gpu01", "password": PASSWORD}
        ).is_success
        assert h.http.post("/api/v1/nodes/actions/provision", json={"nodes": "gpu01"}).is_success
        deadline = time.monotonic() + 60
        while not _powered(h):  # the queue started gpu01: next boot PXE, power-cycled through its BMC
            assert time.monotonic() < deadline, h.http.get("/api/v1/nodes/gpu01").json()
            time.sleep(0.5)
        yield h
    finally:
        server.stop()


def _powered(h: Head) -> bool:
    ops = h.http.get("/api/v1/operations", params={"kind": "provision"}).json()
    items = ops["items"] if isinstance(ops, dict) else ops
    return any(op["state"] == "succeeded" for op in items)


def token_of(text: str) -> str:
    m = re.search(r"bcm\.token=(\S+)", text)
    assert m, text
    return m.group(1)


def events(h: Head, action: str) -> list[dict[str, Any]]:
    r = h.http.get("/api/v1/events", params={"action": action, "limit": 100})
    body = r.json()
    return list(body["items"] if isinstance(body, dict) else body)


def attack(h: Head, node_addr: str, other_addr: str) -> None:
    """The second address knows the MAC and steals the token off the wire: it gets nothing."""
    purpose, text = h.script(NODE_NS)
    assert purpose == "image", text
    token = token_of(text)
    purpose, stolen = h.script(OTHER_NS)
    assert purpose == "refused" and "bcm.token" not in stolen
    assert token_of(h.script(NODE_NS)[1]) == token  # the node's own re-fetch: the same token, still good
    assert h.overlay(OTHER_NS, token) == 403
    assert h.hello(OTHER_NS, token)[0] == 403
    assert h.overlay(NODE_NS, token) == 200
    status, body = h.hello(NODE_NS, token)  # with a forged X-Forwarded-For naming the other address
    assert status == 200, body
    n = h.http.get("/api/v1/nodes/gpu01").json()
    assert n["provision_state"] == "booted" and n["interfaces"][0]["ip"] == node_addr, n
    refused = [e for e in events(h, "boot.script") if "refused" in e["message"]]
    assert refused and all(other_addr in e["message"] and token not in e["message"] for e in refused), refused


@pytest.mark.timeout(240)
@pytest.mark.parametrize("head", ["dhcp"], indirect=True)
def test_with_bcms_dhcp_a_token_goes_only_to_the_lease(head: Head) -> None:
    node_addr, other_addr = lease(NODE_NS), lease(OTHER_NS)
    assert node_addr != other_addr
    leases = (head.server.state_dir / "pxe" / "dnsmasq.leases").read_text()
    assert f"{NODE_MAC} {node_addr}" in leases and f"{OTHER_MAC} {other_addr}" in leases
    attack(head, node_addr, other_addr)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("head", ["proxy"], indirect=True)
def test_in_proxy_mode_the_first_address_binds_the_attempt(head: Head) -> None:
    conf = (head.server.state_dir / "pxe" / "dnsmasq.conf").read_text()
    assert ",proxy" in conf, conf
    attack(head, static(NODE_NS), static(OTHER_NS))
