"""PXE provisioning through the API, on SQLite and PostgreSQL: boot purposes, discovery and assignment, the
provisioning queue behind ``provision`` (a real IPMI BMC emulator on loopback powers a stand-in machine),
the one-time boot token (Ironic's rule), the overlay, the callback, deadlines and a server restart.

The image served is published by the images service from small files (the artifacts' bytes do not matter
to the boot script; a real build and real VM boots are in tests/lab/test_zero_touch.py and the README flows).
"""

from __future__ import annotations

import hashlib
import io
import re
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, select

from bcm.api.app import create_app
from bcm.domain.naming import expand_hostlist
from bcm.drivers import imagebuild
from bcm.lab.chassis import Machine
from bcm.models.event import Event
from bcm.services import images as image_svc
from tests.api.test_power_api import PASSWORD, wait_op

MAC = "52:54:00:aa:00:01"
FACTS = {
    "format_version": 1,
    "kernel": "6.1.0-28-amd64",
    "cpu": {"model": "QEMU Virtual CPU", "vendor": "GenuineIntel", "threads": 4},
    "memory_bytes": 1 << 30,
    "nics": [{"name": "ens3", "mac": MAC, "mtu": 1500, "state": "up", "physical": True}],
    "disks": [{"name": "vda", "size_bytes": 10 << 30, "rotational": False}],
    "pci_devices": [{"slot": "0000:00:04.0", "vendor_id": "10de", "device_id": "2330", "class_id": "0302"}],
}


@pytest.fixture(autouse=True)
def fresh_event_throttle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts a server, and a started server has counted no refusals yet (the per-client event
    throttle lives in the process, which all tests share)."""
    from bcm.services import events as events_svc

    monkeypatch.setattr(events_svc, "_throttle", events_svc._Throttle())


def publish_image(engine: Any, settings: Any, name: str = "img") -> str:
    """Publish version 1 of ``name`` from three small files, through the images service."""
    with Session(engine) as s:
        image = image_svc.begin_build(s, name, None, "test")
        staging = image_svc.staging_dir(settings.images_dir, name, image.version, 1)
        staging.mkdir(parents=True)
        found = []
        for kind, filename in (
            ("kernel", "vmlinuz"),
            ("initramfs", "initramfs.img"),
            ("rootfs", "rootfs.squashfs"),
        ):
            data = f"{kind} of {name}".encode()
            (staging / filename).write_bytes(data)
            found.append(imagebuild.Artifact(kind, filename, len(data), hashlib.sha256(data).hexdigest()))
        image_svc.publish(s, image, staging, settings.images_dir, found, {}, 3)
        s.commit()
        return image.version


def events(engine: Any, action: str) -> list[Event]:
    with Session(engine) as s:
        return list(s.exec(select(Event).where(Event.action == action)))


def script(api: TestClient, mac: str) -> tuple[str, str]:
    r = api.get(f"/boot/v1/ipxe/{mac.replace(':', '-')}", headers={"Authorization": ""})
    assert r.status_code == 200, r.text
    assert r.text.startswith("#!ipxe\n")
    return r.headers["x-bcm-purpose"], r.text


def token_of(text: str) -> str:
    m = re.search(r"bcm\.token=(\S+)", text)
    assert m, text
    return m.group(1)


def node(api: TestClient, name: str) -> dict[str, Any]:
    r = api.get(f"/api/v1/nodes/{name}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def wait_state(api: TestClient, name: str, state: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = node(api, name)
        if n["provision_state"] == state:
            return n
        time.sleep(0.2)
    raise AssertionError(f"{name} is {node(api, name)['provision_state']}, not {state}, after {timeout_s}s")


def add_with_bmc(api: TestClient, name: str, mac: str, spec: Any, **extra: Any) -> None:
    body = {
        "name": name,
        "mac": mac,
        "bmc_address": spec.address,
        "bmc_protocol": spec.kind,
        "bmc_user": "admin",
        **extra,
    }
    assert api.post("/api/v1/nodes", json=body).status_code == 201
    r = api.put("/api/v1/nodes/bmc-password", json={"nodes": name, "password": PASSWORD})
    assert r.status_code in (200, 204), r.text


def provision_op(api: TestClient, name: str) -> dict[str, Any]:
    """The provision operation the queue started for ``name`` (its PXE power step)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ops = api.get("/api/v1/operations", params={"kind": "provision"}).json()
        items = ops["items"] if isinstance(ops, dict) else ops
        for op in items:
            if name in expand_hostlist(op["targets"]):
                return wait_op(api, op["id"])
        time.sleep(0.2)
    raise AssertionError(
        f"no provision operation for {name}: {api.get('/api/v1/operations').json()} {node(api, name)}"
    )


def test_entry_script_chains_to_the_mac(api: TestClient) -> None:
    r = api.get("/boot/v1/ipxe/boot.ipxe", headers={"Authorization": ""})
    assert r.status_code == 200
    assert "/boot/v1/ipxe/${netX/mac:hexhyp}" in r.text


def test_unknown_mac_without_any_image_gets_the_noimage_script_and_an_event(
    api: TestClient, engine: Any
) -> None:
    purpose, text = script(api, MAC)
    assert purpose == "noimage" and "no discovery image" in text
    assert any(e.target == MAC for e in events(engine, "boot.discovery"))
    assert api.get("/boot/v1/ipxe/not-a-mac", headers={"Authorization": ""}).status_code == 422


def test_discovery_then_assign(api: TestClient, engine: Any, settings: Any) -> None:
    version = publish_image(engine, settings)
    purpose, text = script(api, MAC)
    assert purpose == "discovery"
    assert (
        f"/boot/v1/images/img/{version}/vmlinuz" in text
        and "bcm.discover=" in text
        and "bcm.token" not in text
    )
    r = api.post(
        "/boot/v1/discover", json={"mac": MAC.upper(), "facts": FACTS}, headers={"Authorization": ""}
    )
    assert r.status_code == 202, r.text
    assert r.json() == {
        "node": "mac-525400aa0001",
        "state": "discovered",
        "assigned": False,
        "provisioning": False,
    }
    listed = api.get("/api/v1/discovered").json()
    assert [(d["mac"], d["threads"], d["nvidia_pci_devices"], d["disks"]) for d in listed] == [(MAC, 4, 1, 1)]
    # a second report of the same machine updates it; a bad one is a 422 naming the field, and stores nothing
    FACTS2 = {**FACTS, "cpu": {"threads": 8}}
    assert (
        api.post(
            "/boot/v1/discover", json={"mac": MAC, "facts": FACTS2}, headers={"Authorization": ""}
        ).status_code
        == 202
    )
    bad = api.post("/boot/v1/discover", json={"mac": "zz", "facts": FACTS}, headers={"Authorization": ""})
    assert bad.status_code == 422 and bad.json()["field"] == "mac"
    assert [d["threads"] for d in api.get("/api/v1/discovered").json()] == [8]
    # still discovery until assigned
    assert script(api, MAC)[0] == "discovery"
    r = api.post("/api/v1/discovered/assign", json={"mac": MAC, "name": "gpu01", "image": "img"})
    assert r.status_code == 200, r.text
    assert r.json()["provision_state"] == "registered" and r.json()["image"] == "img"
    assert api.get("/api/v1/discovered").json() == []
    again = api.post("/api/v1/discovered/assign", json={"mac": MAC, "name": "gpu02"})
    assert again.status_code == 409
    unknown = api.post("/api/v1/discovered/assign", json={"mac": "52:54:00:aa:00:99", "name": "gpu03"})
    assert unknown.status_code == 404
    # a known node that is not provisioning boots locally
    assert script(api, MAC)[0] == "local"


def test_discovery_is_bounded(api: TestClient, settings: Any) -> None:
    settings.pxe.max_discovered = 2
    for i in range(2):
        r = api.post(
            "/boot/v1/discover",
            json={"mac": f"52:54:00:aa:01:0{i}", "facts": FACTS},
            headers={"Authorization": ""},
        )
        assert r.status_code == 202
    r = api.post(
        "/boot/v1/discover", json={"mac": "52:54:00:aa:01:09", "facts": FACTS}, headers={"Authorization": ""}
    )
    assert r.status_code == 409 and "limit 2" in r.json()["message"]
    assert len(api.get("/api/v1/discovered").json()) == 2


def test_provision_boot_token_overlay_and_callback(
    api: TestClient, engine: Any, settings: Any, bmcs: dict[str, Any]
) -> None:
    publish_image(engine, settings)
    spec = bmcs["ipmi"]
    add_with_bmc(api, "gpu01", MAC, spec, image="img")
    r = api.post("/api/v1/nodes/actions/provision", json={"nodes": "gpu01"})
    assert r.status_code == 200, r.text
    assert r.json()["nodes"][0]["status"] == "queued"
    op = provision_op(api, "gpu01")
    assert op["state"] == "succeeded" and op["results"]["gpu01"]["status"] == "ok", op
    machine = Machine(spec.dir)
    assert machine.is_on() and machine.boot() == "default"  # the one-time PXE boot was used by this power-on
    assert node(api, "gpu01")["provision_state"] == "provisioning"

    purpose, text = script(api, MAC)
    assert purpose == "image" and "/boot/v1/images/img/1/rootfs.squashfs" in text
    token = token_of(text)
    assert token_of(script(api, MAC)[1]) == token  # a second fetch (a reboot) gets the same one (#26)
    first = "bcmboot_" + "x" * 43  # a guess

    def overlay(tok: str | None, mac: str = MAC) -> Any:
        return api.get(f"/boot/v1/overlay/{mac}", headers={"Authorization": f"Bearer {tok}" if tok else ""})

    assert overlay(None).status_code == 401
    assert overlay(first).status_code == 401
    assert overlay(token, "52:54:00:aa:00:02").status_code == 403
    r = overlay(token)
    assert r.status_code == 200 and r.headers["content-type"] == "application/gzip"
    files = tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz")  # noqa: SIM115
    names = set(files.getnames())
    assert {
        "etc/hostname",
        "etc/ssh/ssh_host_ed25519_key",
        "root/.ssh/authorized_keys",
        "usr/local/sbin/bcm-hello",
    } <= names
    pub = files.extractfile("etc/ssh/ssh_host_ed25519_key.pub").read().decode()  # type: ignore[union-attr]
    assert files.getmember("etc/ssh/ssh_host_ed25519_key").mode == 0o600
    head_key = settings.ssh_key_file.with_suffix(".pub").read_text().strip()
    assert files.extractfile("root/.ssh/authorized_keys").read().decode().strip() == head_key  # type: ignore[union-attr]
    with Session(engine) as s:
        from bcm.models.node import Node

        pinned = s.exec(select(Node).where(Node.name == "gpu01")).one().ssh_host_key
    assert pinned and pub.startswith(pinned)

    def hello(tok: str | None, mac: str = MAC) -> Any:
        return api.post(
            "/boot/v1/hello", json={"mac": mac}, headers={"Authorization": f"Bearer {tok}" if tok else ""}
        )

    assert hello(token, "52:54:00:aa:00:02").status_code == 403  # foreign machine
    assert hello(first).status_code == 401  # guessed
    r = hello(token)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert (
        answer["node"] == "gpu01" and answer["state"] == "booted" and answer["agent_token"].startswith("bcm")
    )
    assert hello(token).status_code == 401  # replayed
    assert overlay(token).status_code == 401  # used
    refusals = [e.message for e in events(engine, "boot.token")]  # one a minute per client, the rest summed
    assert any("unknown boot token" in m or "more like this" in m for m in refusals), refusals
    assert all(token not in m and first not in m for m in refusals)
    n = node(api, "gpu01")
    assert n["provision_state"] == "booted" and n["last_error"] is None
    # the agent token is a node token of gpu01: the report endpoint takes it (and judges the body)
    rep = api.post(
        "/boot/v1/agent/report", content=b"{}", headers={"Authorization": f"Bearer {answer['agent_token']}"}
    )
    assert rep.status_code == 422
    # booted: the script is local now, and the next provision mints a token again
    assert script(api, MAC)[0] == "local"


def test_no_image_fails_the_node_and_a_missing_artifact_too(
    api: TestClient, engine: Any, settings: Any, bmcs: dict[str, Any]
) -> None:
    add_with_bmc(api, "gpu01", MAC, bmcs["ipmi"])
    assert api.post("/api/v1/nodes/actions/provision", json={"nodes": "gpu01"}).status_code == 200
    provision_op(api, "gpu01")
    purpose, text = script(api, MAC)
    assert purpose == "noimage" and "no image assigned" in text
    n = node(api, "gpu01")
    assert n["provision_state"] == "failed" and "no image assigned" in n["last_error"]
    version = publish_image(engine, settings)
    assert api.patch("/api/v1/nodes/gpu01", json={"image": "img"}).status_code == 200
    (image_svc.version_dir(settings.images_dir, "img", version) / "initramfs.img").unlink()
    assert api.post("/api/v1/nodes/actions/provision", json={"nodes": "gpu01"}).status_code == 200
    purpose, text = script(api, MAC)
    assert purpose == "noimage" and "initramfs.img is missing" in text
    assert node(api, "gpu01")["provision_state"] == "failed"


def test_a_node_without_a_bmc_fails_with_the_reason(api: TestClient) -> None:
    assert api.post("/api/v1/nodes", json={"name": "gpu01", "mac": MAC}).status_code == 201
    assert api.post("/api/v1/nodes/actions/provision", json={"nodes": "gpu01"}).status_code == 200
    n = wait_state(api, "gpu01", "failed")
    assert "no_bmc" in n["last_error"]


def test_deadline_expired_token_and_queue_limit(
    api: TestClient, engine: Any, settings: Any, bmcs: dict[str, Any]
) -> None:
    publish_image(engine, settings)
    settings.pxe.max_concurrent = 1
    add_with_bmc(api, "gpu01", MAC, bmcs["ipmi"], image="img")
    add_with_bmc(api, "gpu02", "52:54:00:aa:00:02", bmcs["redfish"], image="img")
    assert api.post("/api/v1/nodes/actions/provision", json={"nodes": "gpu[01-02]"}).status_code == 200
    provision_op(api, "gpu01")
    token = token_of(script(api, MAC)[1])
    # one at a time: gpu02 waits its turn (never powered) while gpu01 is in flight
    assert not Machine(bmcs["redfish"].dir).is_on()
    assert node(api, "gpu02")["provision_state"] == "provisioning"
    # the clock passes gpu01's deadline (and its token's, which is the same)
    from bcm.models.base import utcnow
    from bcm.models.node import Node
    from bcm.models.pxe import BootToken

    with Session(engine) as s:
        n1 = s.exec(select(Node).where(Node.name == "gpu01")).one()
        n1.provision_deadline = utcnow()
        for t in s.exec(select(BootToken).where(BootToken.node_id == n1.id)):
            t.expires_at = n1.provision_deadline
            s.add(t)
        s.add(n1)
        s.commit()
    n = wait_state(api, "gpu01", "failed", timeout_s=30)
    assert "did not call back" in n["last_error"]
    r = api.post("/boot/v1/hello", json={"mac": MAC}, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 401 and "expired" in r.json()["message"]
    # gpu01 done (failed): gpu02's turn
    provision_op(api, "gpu02")
    assert Machine(bmcs["redfish"].dir).is_on()


@pytest.fixture
def restartable(settings: Any, engine: Any) -> Iterator[Any]:
    """Start (and stop) TestClients of the same server state, one after another."""
    clients: list[TestClient] = []
    token = settings.admin_token_file.read_text().strip()

    def start() -> TestClient:
        c = TestClient(create_app(settings, engine))
        c.__enter__()  # noqa: PLC2801 - entered here, left in the fixture's teardown
        c.headers["Authorization"] = f"Bearer {token}"
        clients.append(c)
        return c

    yield start
    for c in clients:
        c.__exit__(None, None, None)


def test_provisioning_survives_a_restart(
    restartable: Any, engine: Any, settings: Any, bmcs: dict[str, Any]
) -> None:
    api = restartable()
    publish_image(engine, settings)
    add_with_bmc(api, "gpu01", MAC, bmcs["ipmi"], image="img")
    add_with_bmc(api, "gpu02", "52:54:00:aa:00:02", bmcs["redfish"], image="img")
    assert api.post("/api/v1/nodes/actions/provision", json={"nodes": "gpu[01-02]"}).status_code == 200
    provision_op(api, "gpu01")
    provision_op(api, "gpu02")
    token = token_of(script(api, MAC)[1])
    api.__exit__(None, None, None)  # the server stops while both wait for their callback
    # gpu02's deadline passes while the server is down
    from bcm.models.base import utcnow
    from bcm.models.node import Node

    with Session(engine) as s:
        n2 = s.exec(select(Node).where(Node.name == "gpu02")).one()
        assert n2.provision_state == "provisioning"
        n2.provision_deadline = utcnow()
        s.add(n2)
        s.commit()
    api = restartable()
    assert "did not call back" in wait_state(api, "gpu02", "failed")["last_error"]
    assert node(api, "gpu01")["provision_state"] == "provisioning"
    r = api.post("/boot/v1/hello", json={"mac": MAC}, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    assert node(api, "gpu01")["provision_state"] == "booted"


def test_dhcp_host_files_follow_the_database(api: TestClient, engine: Any, settings: Any) -> None:
    from bcm.drivers import dnsmasq
    from bcm.services import pxe

    assert (
        api.post("/api/v1/nodes", json={"name": "gpu01", "mac": MAC, "ip": "198.18.0.50"}).status_code == 201
    )
    assert (
        api.post(
            "/boot/v1/discover",
            json={"mac": "52:54:00:aa:00:05", "facts": FACTS},
            headers={"Authorization": ""},
        ).status_code
        == 202
    )
    with Session(engine) as s:
        entries = pxe.host_entries(s)
    assert entries == [(MAC, "198.18.0.50", "gpu01")]  # discovered machines get no fixed entry
    hosts = Path(settings.state_dir) / "pxe" / "hosts"
    dnsmasq.write_hosts(hosts, entries)
    assert (
        (hosts / "52-54-00-aa-00-01.conf")
        .read_text()
        .endswith("dhcp-host=52:54:00:aa:00:01,198.18.0.50,gpu01\n")
    )


def test_pxe_enable_supervise_disable_and_keep_across_restarts(
    restartable: Any, settings: Any, engine: Any
) -> None:
    """`bcm pxe enable` through the API: checked by dnsmasq first, supervised (a killed dnsmasq comes back),
    disabled, and kept across a restart. The interface does not exist, so dnsmasq serves no one."""
    import os
    import shutil
    import signal

    if shutil.which("dnsmasq") is None:
        pytest.skip("dnsmasq-base is not installed")
    api = restartable()
    body = {
        "enabled": True,
        "interface": "bcmt-nowhere0",
        "address": "198.18.99.1",
        "range_start": "198.18.99.100",
        "range_end": "198.18.99.150",
    }
    for field, value in (("range_start", "198.19.2.3"), ("address", "not-an-ip"), ("interface", "a b")):
        bad = api.put("/api/v1/pxe", json={**body, field: value})
        assert bad.status_code == 422 and bad.json()["field"] == field, bad.text
    assert api.get("/api/v1/pxe").json()["enabled"] is False
    viewer = api.post("/api/v1/tokens", json={"name": "v", "role": "viewer"}).json()["token"]
    assert api.put("/api/v1/pxe", json=body, headers={"Authorization": f"Bearer {viewer}"}).status_code == 403
    r = api.put("/api/v1/pxe", json=body)
    assert r.status_code == 200, r.text
    st = r.json()
    assert st["enabled"] and st["source"] == "api" and st["dnsmasq_pid"]
    assert st["server_url"] == f"http://198.18.99.1:{settings.port}"
    conf = (settings.state_dir / "pxe" / "dnsmasq.conf").read_text()
    assert "interface=bcmt-nowhere0\n" in conf and "dhcp-range=198.18.99.100,198.18.99.150," in conf
    assert sorted(p.name for p in (settings.state_dir / "pxe" / "tftp").iterdir()) == [
        "ipxe.efi",
        "undionly.kpxe",
    ]
    # the boot scripts now name the PXE address
    assert "http://198.18.99.1:" in api.get("/boot/v1/ipxe/boot.ipxe", headers={"Authorization": ""}).text

    first = st["dnsmasq_pid"]
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while (now := api.get("/api/v1/pxe").json())["dnsmasq_pid"] in (None, first):
        assert time.monotonic() < deadline, now
        time.sleep(0.2)
    assert now["dnsmasq_restarts"] == 1 and os.path.exists(f"/proc/{now['dnsmasq_pid']}")
    scraped = api.get("/metrics").text.splitlines()  # what docs/prometheus/bcm-rules.yml alerts on
    assert "bcm_dnsmasq_restarts_total 1.0" in scraped and "bcm_dnsmasq_running 1.0" in scraped

    api.__exit__(None, None, None)  # a restart: the stored settings come back, and dnsmasq with them
    assert (
        not os.path.exists(f"/proc/{now['dnsmasq_pid']}")
        or Path(f"/proc/{now['dnsmasq_pid']}/stat").read_text().split()[2] == "Z"
    )
    api = restartable()
    again = api.get("/api/v1/pxe").json()
    assert again["enabled"] and again["interface"] == "bcmt-nowhere0" and again["dnsmasq_pid"]

    off = api.put("/api/v1/pxe", json={"enabled": False}).json()
    assert off["enabled"] is False and off["dnsmasq_pid"] is None and off["interface"] == "bcmt-nowhere0"
    assert any(e.message.startswith("PXE disabled") for e in events(engine, "pxe.config"))


def test_a_category_rule_assigns_discovered_machines(api: TestClient, engine: Any) -> None:
    r = api.post(
        "/api/v1/categories",
        json={"name": "dgx", "discover_mac_prefix": "52-54-00-AA", "discover_names": "dgx[01-02]"},
    )
    assert r.status_code == 201, r.text
    assert r.json()["discover_mac_prefix"] == "52:54:00:aa"
    bad = api.post("/api/v1/categories", json={"name": "x", "discover_mac_prefix": "zz:1"})
    assert bad.status_code == 422 and bad.json()["field"] == "discover_mac_prefix"
    bad = api.post("/api/v1/categories", json={"name": "x", "discover_names": "Not_A_Name[1-2]"})
    assert bad.status_code == 422 and bad.json()["field"] == "discover_names"
    assert api.post("/api/v1/nodes", json={"name": "dgx01"}).status_code == 201  # taken: the rule skips it

    def discover(mac: str) -> dict[str, Any]:
        r = api.post("/boot/v1/discover", json={"mac": mac, "facts": FACTS}, headers={"Authorization": ""})
        assert r.status_code == 202, r.text
        return dict(r.json())

    assert discover("52:54:00:aa:00:01") == {
        "node": "dgx02",
        "state": "registered",
        "assigned": True,
        "provisioning": False,
    }
    n = node(api, "dgx02")
    assert n["category"] == "dgx" and n["interfaces"][0]["mac"] == "52:54:00:aa:00:01"
    assert discover("52:54:00:aa:00:02")["state"] == "discovered"  # the pool is used up
    assert discover("52:54:00:bb:00:01")["state"] == "discovered"  # no rule matches
    assert any("no free name left" in e.message for e in events(engine, "node.discovered"))
    assert {d["mac"] for d in api.get("/api/v1/discovered").json()} == {
        "52:54:00:aa:00:02",
        "52:54:00:bb:00:01",
    }


def test_a_token_goes_only_to_the_address_leased_to_the_mac(
    api: TestClient, engine: Any, settings: Any, bmcs: dict[str, Any], tmp_path: Path
) -> None:
    """With bcm's own DHCP, the image script (it carries a boot token) is answered only to the MAC's lease."""
    from bcm.drivers import dnsmasq
    from bcm.services import pxe

    leases = tmp_path / "dnsmasq.leases"
    # the MAC's two leases: iPXE's (no client identifier) and an installed system's own DHCP client's (a DUID)
    leases.write_text(
        f"1796304016 {MAC} 198.18.80.133 * *\n1796304013 52:54:00:aa:00:02 198.18.80.134 * x\n"
        f"1796304019 {MAC} 198.18.80.135 vm01 ff:56:50:4d:98:00:02:00:00:ab:11:0b:1c\n"
    )
    assert dnsmasq.leased_addresses(leases, MAC) == ("198.18.80.133", "198.18.80.135")
    assert dnsmasq.leased_addresses(leases, "52:54:00:aa:00:09") == ()
    assert dnsmasq.leased_addresses(tmp_path / "none", MAC) == ()
    publish_image(engine, settings)
    add_with_bmc(api, "gpu01", MAC, bmcs["ipmi"], image="img")
    assert api.post("/api/v1/nodes/actions/provision", json={"nodes": "gpu01"}).status_code == 200
    provision_op(api, "gpu01")
    with Session(engine) as s:
        other = pxe.boot_script(
            s,
            settings,
            MAC,
            peer="198.18.80.134",
            leased=("198.18.80.133", "198.18.80.135"),
            check_lease=True,
        )
        none = pxe.boot_script(s, settings, MAC, peer="198.18.80.133", leased=(), check_lease=True)
        # iPXE asks from its own lease while the installed system's lease is still in the file
        mine = pxe.boot_script(
            s,
            settings,
            MAC,
            peer="198.18.80.133",
            leased=("198.18.80.135", "198.18.80.133"),
            check_lease=True,
        )
        s.commit()
    assert other.purpose == none.purpose == "refused" and "bcm.token" not in other.text + none.text
    assert mine.purpose == "image" and "bcm.token=" in mine.text
    assert node(api, "gpu01")["provision_state"] == "provisioning"  # a refusal does not fail the node
    assert any("refused to 198.18.80.134" in e.message for e in events(engine, "boot.script"))


def test_the_init_reports_a_failed_boot_with_the_attempts_token(
    api: TestClient, engine: Any, settings: Any, bmcs: dict[str, Any]
) -> None:
    """templates/image/init's fail() posts its line with the one-time token: the node fails at once."""
    publish_image(engine, settings)
    add_with_bmc(api, "gpu01", MAC, bmcs["ipmi"], image="img")
    assert api.post("/api/v1/nodes/actions/provision", json={"nodes": "gpu01"}).status_code == 200
    provision_op(api, "gpu01")
    token = token_of(script(api, MAC)[1])

    def failed(tok: str | None, body: dict[str, Any]) -> Any:
        return api.post(
            "/boot/v1/failed", json=body, headers={"Authorization": f"Bearer {tok}" if tok else ""}
        )

    line = {"mac": MAC, "message": "bcm-init: sha256 of http://h/rootfs.squashfs is not 1f2e\x07"}
    assert failed(None, line).status_code == 401
    assert failed("bcmboot_" + "x" * 43, line).status_code == 401
    assert failed(token, {**line, "mac": "52:54:00:aa:00:02"}).status_code == 403  # another machine's
    assert failed(token, {**line, "message": "x" * 501}).status_code == 422
    assert node(api, "gpu01")["provision_state"] == "provisioning"  # nothing of that changed anything
    r = failed(token, line)
    assert r.status_code == 200 and r.json() == {"node": "gpu01", "state": "failed"}, r.text
    n = node(api, "gpu01")
    assert n["provision_state"] == "failed"
    assert n["last_error"].endswith("bcm-init: sha256 of http://h/rootfs.squashfs is not 1f2e"), n[
        "last_error"
    ]
    assert failed(token, line).status_code == 401  # used up: it cannot fail the node's next attempt
    init = (Path(__file__).resolve().parents[2] / "templates" / "image" / "init").read_text()
    assert '"$server_url/boot/v1/failed"' in init and "Authorization: Bearer $token" in init
