"""With TLS on, a node's overlay carries bcm's CA, and its callback and agent go to the API over https."""

from __future__ import annotations

import io
import json
import tarfile
from typing import Any

from fastapi.testclient import TestClient

from bcm.services import agents as agent_svc
from bcm.services import tls
from bcm.services.render import render
from tests.api.test_pxe_api import MAC, add_with_bmc, provision_op, publish_image, script, token_of


def _hello_source(files: tarfile.TarFile) -> str:
    member = files.extractfile("usr/local/sbin/bcm-hello")
    assert member is not None
    return member.read().decode()


def test_overlay_carries_the_ca_and_the_https_callback(
    api: TestClient, engine: Any, settings: Any, bmcs: dict[str, Any]
) -> None:
    settings.tls.enabled = True
    settings.pxe.address = "198.18.0.1"
    served = tls.prepare(settings, "198.18.0.1")
    publish_image(engine, settings)
    add_with_bmc(api, "gpu01", MAC, bmcs["ipmi"], image="img")
    assert api.post("/api/v1/nodes/actions/provision", json={"nodes": "gpu01"}).status_code == 200
    assert provision_op(api, "gpu01")["state"] == "succeeded"
    _purpose, text = script(api, MAC)
    # the kernel, initramfs, root file system and overlay come from the plain boot port
    boot = f"http://198.18.0.1:{settings.tls.boot_port}"
    assert f"{boot}/boot/v1/images/img/1/rootfs.squashfs" in text and f"bcm.server={boot}" in text
    r = api.get(f"/boot/v1/overlay/{MAC}", headers={"Authorization": f"Bearer {token_of(text)}"})
    assert r.status_code == 200, r.text
    files = tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz")  # noqa: SIM115
    ca = files.extractfile("etc/bcm/ca.pem")
    assert ca is not None and ca.read() == served.ca_pem
    assert files.getmember("etc/bcm/ca.pem").mode == 0o644
    hello = _hello_source(files)
    compile(hello, "bcm-hello", "exec")  # valid Python as rendered
    api_url = f"https://198.18.0.1:{settings.port}"
    assert f'server = "{api_url}"' in hello
    assert 'ssl.create_default_context(cafile="/etc/bcm/ca.pem")' in hello
    assert 'agent = {"server_url": server, "ca_file": "/etc/bcm/ca.pem"}' in hello


def test_without_tls_the_callback_uses_the_kernel_command_line() -> None:
    ctx = {"node": "gpu01", "api_url": None, "ca_file": None}
    hello = render("overlay/usr/local/sbin/bcm-hello.j2", **ctx)
    compile(hello, "bcm-hello", "exec")
    # the first boot's callback: plain, to the kernel command line's server (a disk-booted system's callback,
    # disk_hello, follows whatever URL its stored agent config names)
    first_boot = hello.split("def disk_hello")[0] + hello.split("\n\n\nif not token")[1]
    assert "https" not in first_boot and 'agent = {"server_url": server}' in first_boot


def test_agent_deploy_pushes_the_ca_with_an_https_url(settings: Any) -> None:
    spec = agent_svc.DeploySpec("https://198.18.0.1:8470", 30.0)
    assert agent_svc.ca_for(settings, spec) is None  # TLS off: nothing to push
    settings.tls.enabled = True
    served = tls.prepare(settings)
    assert agent_svc.ca_for(settings, spec) == served.ca_pem
    assert agent_svc.ca_for(settings, agent_svc.DeploySpec("http://198.18.0.1:8470", 30.0)) is None
    config = json.loads(agent_svc.agent_config(spec, "bcm_x", 8, with_ca=True))
    assert config["ca_file"] == agent_svc.CA_PATH and config["server_url"] == "https://198.18.0.1:8470"


def test_agent_deploy_refuses_a_plain_url_while_tls_is_on(api: TestClient, settings: Any) -> None:
    settings.tls.enabled = True
    r = api.post("/api/v1/agents/deploy", json={"nodes": "gpu01", "server_url": "http://198.18.0.1:8470"})
    assert r.status_code == 422 and r.json()["field"] == "server_url" and "https" in r.json()["message"]
