"""The API over TLS: a real `bcm serve` with BCM_TLS__ENABLED, the real CLI, loopback only.

bcm's CA fetched once and checked by fingerprint; the CLI verifies the server against it and refuses
without it; the certificate names what was configured; the plain port serves the boot files only; an
admin's own certificate works; bad TLS settings stop the start with one line.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from bcm.agent.reporter import SendError, opener_for, post_json
from bcm.devserver import Server
from bcm.services import tls
from bcm.services.render import render
from tests.integration.test_cli import failed_with, ok

NAMES = "bcm-head.test,198.18.0.1"


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path / "state", tls=True, extra_env={"BCM_TLS__NAMES": NAMES})
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def remote(srv: Server, home: Path, **env: str) -> dict[str, str]:
    """An admin's machine: no state dir of the server's (so no CA of its own), the token given."""
    return {
        "BCM_STATE_DIR": str(home / "no-state"),
        "XDG_CONFIG_HOME": str(home / "config"),
        "BCM_TOKEN": srv.token(),
        **env,
    }


def shown_fingerprint(srv: Server) -> str:
    lines = ok(srv.cli("ca", "show")).splitlines()
    assert lines[0].startswith("SHA256:") and len(lines[0]) == 7 + 32 * 3 - 1, lines
    return lines[0]


def test_cli_over_https_after_ca_fetch(tls_server: Server, tmp_path: Path) -> None:
    srv = tls_server
    fp = shown_fingerprint(srv)
    assert f"CA fingerprint {fp}" in (srv.log.read_text() if srv.log else "")  # serve logs it at start
    admin = remote(srv, tmp_path)
    stored = tmp_path / "config" / "bcm" / "ca.pem"

    # no CA yet: a clear refusal, not an unverified connection
    failed_with(srv.cli("node", "list", **admin), "does not verify", "bcm ca fetch --fingerprint")
    # a wrong fingerprint: one line naming the real one, nothing stored
    wrong = "SHA256:" + ":".join(["AB"] * 32)
    failed_with(
        srv.cli("ca", "fetch", "--fingerprint", wrong, **admin), "not the one given", fp, "nothing stored"
    )
    failed_with(srv.cli("ca", "fetch", "--fingerprint", "SHA256:12:34", **admin), "fingerprint", "64 hex")
    assert not stored.exists()

    out = ok(srv.cli("ca", "fetch", "--fingerprint", fp, **admin))
    assert f"stored bcm's CA {fp} in {stored}" in out
    assert stored.read_bytes() == (srv.state_dir / "tls" / "ca.crt").read_bytes()
    ok(srv.cli("node", "add", "gpu[01-02]", "--mac", "52:54:00:00:31:01", **admin))
    assert [n["name"] for n in json.loads(ok(srv.cli("node", "list", "--json", **admin)))] == [
        "gpu01",
        "gpu02",
    ]
    # fetched as plain hex without colons, from the boot port, into BCM_CA_CERT: the same file
    elsewhere = tmp_path / "elsewhere.pem"
    hex_fp = fp.removeprefix("SHA256:").replace(":", "").lower()
    ok(
        srv.cli(
            "--url", srv.boot_url, "ca", "fetch", "--fingerprint", hex_fp, **admin, BCM_CA_CERT=str(elsewhere)
        )
    )
    assert elsewhere.read_bytes() == stored.read_bytes()
    # a CA that is not the server's: the CLI refuses (BCM_CA_CERT wins over the stored one)
    other, _ = tls.make_ca(tls.dt.datetime.now(tls.dt.UTC), "another CA")
    stranger = tmp_path / "stranger.pem"
    stranger.write_bytes(other.public_bytes(serialization.Encoding.PEM))
    failed_with(srv.cli("node", "list", **admin, BCM_CA_CERT=str(stranger)), "does not verify", str(stranger))
    # the plain URL of the TLS port is no way round it
    failed_with(srv.cli("node", "list", **admin, BCM_URL=f"http://127.0.0.1:{srv.port}"))
    # on the head, as the server's user, the CLI verifies against the server's own CA file
    assert json.loads(ok(srv.cli("node", "list", "--json")))[0]["name"] == "gpu01"


def test_certificate_names_what_was_configured(tls_server: Server) -> None:
    ca_file = tls_server.state_dir / "tls" / "ca.crt"
    context = ssl.create_default_context(cafile=str(ca_file))
    for name in ("bcm-head.test", "198.18.0.1", "localhost", "127.0.0.1", socket.gethostname()):
        with (
            socket.create_connection(("127.0.0.1", tls_server.port), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname=name) as conn,
        ):
            peer = conn.getpeercert()
            assert peer is not None
            names = {value for _kind, value in peer["subjectAltName"]}
            assert {"bcm-head.test", "198.18.0.1", "localhost", "127.0.0.1"} <= names
    for name in ("other.test", "198.18.0.2"):
        with (
            socket.create_connection(("127.0.0.1", tls_server.port), timeout=10) as raw,
            pytest.raises(ssl.SSLCertVerificationError, match="mismatch|doesn't match"),
        ):
            context.wrap_socket(raw, server_hostname=name)
    # a TLS 1.2 client gets a forward-secret AEAD suite (1.3's are all AEAD)
    tls12 = ssl.create_default_context(cafile=str(ca_file))
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2
    tls12.set_ciphers("ALL:@SECLEVEL=0")  # offer everything, old suites included: the server chooses
    with (
        socket.create_connection(("127.0.0.1", tls_server.port), timeout=10) as raw,
        tls12.wrap_socket(raw, server_hostname="bcm-head.test") as conn,
    ):
        suite = conn.cipher()
        assert suite is not None and conn.version() == "TLSv1.2"
        assert suite[0].startswith("ECDHE-") and ("GCM" in suite[0] or "CHACHA20" in suite[0]), suite
    der = ssl.get_server_certificate(("127.0.0.1", tls_server.port))
    served = x509.load_pem_x509_certificate(der.encode())
    basic = served.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert basic.ca is False


def _handshake(port: int, ca_file: Path, name: str) -> None:
    context = ssl.create_default_context(cafile=str(ca_file))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=name),
    ):
        pass


def test_a_new_pxe_address_is_named_from_the_next_handshake(tls_server: Server) -> None:
    ca_file = tls_server.state_dir / "tls" / "ca.crt"
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(tls_server.port, ca_file, "198.18.0.77")
    api = httpx.Client(base_url=tls_server.url, verify=tls_server.verify(), timeout=30)
    r = api.put(
        "/api/v1/pxe",
        json={"enabled": False, "address": "198.18.0.77"},
        headers={"Authorization": f"Bearer {tls_server.token()}"},
    )
    assert r.status_code == 200, r.text
    _handshake(tls_server.port, ca_file, "198.18.0.77")  # same CA, a certificate that names it
    _handshake(tls_server.port, ca_file, "bcm-head.test")
    assert "server certificate issued again" in (tls_server.log.read_text() if tls_server.log else "")


def test_plain_port_serves_boot_files_only(tls_server: Server) -> None:
    boot = tls_server.boot_url
    script = httpx.get(f"{boot}/boot/v1/ipxe/boot.ipxe", timeout=10)
    assert script.status_code == 200 and script.text.startswith("#!ipxe")
    assert f"chain --autofree {boot}/boot/v1/ipxe/" in script.text  # iPXE stays on the plain port
    discovery = httpx.get(f"{boot}/boot/v1/ipxe/52-54-00-00-31-09", timeout=10)
    assert discovery.status_code == 200 and discovery.headers["x-bcm-purpose"] in ("discovery", "noimage")
    ca = httpx.get(f"{boot}/boot/v1/ca.pem", timeout=10)
    assert ca.status_code == 200 and ca.content == (tls_server.state_dir / "tls" / "ca.crt").read_bytes()
    token = {"Authorization": f"Bearer {tls_server.token()}"}
    for method, path in (
        ("GET", "/api/v1/nodes"),
        ("GET", "/healthz"),
        ("GET", "/metrics"),
        ("GET", "/ui/"),
        ("POST", "/boot/v1/agent/report"),
        ("POST", "/boot/v1/hello"),
        ("POST", "/boot/v1/hello/disk"),  # a disk-booted system's callback carries its agent token
        ("GET", "/openapi.json"),
    ):
        r = httpx.request(method, f"{boot}{path}", headers=token, timeout=10)
        assert r.status_code == 404, (path, r.status_code)
        assert "the API is at https://" in r.json()["message"]
    # the install plan and its report go with the one-time boot token, as the overlay does: on the plain port
    # (401: no token; the route is there)
    assert httpx.get(f"{boot}/boot/v1/install/52-54-00-00-31-09", timeout=10).status_code == 401
    assert httpx.post(f"{boot}/boot/v1/installed", json={}, timeout=10).status_code == 401
    # the TLS port serves everything, boot files included
    api = httpx.Client(base_url=tls_server.url, verify=tls_server.verify(), headers=token, timeout=10)
    assert api.get("/api/v1/nodes").status_code == 200
    assert api.get("/boot/v1/ipxe/boot.ipxe").status_code == 200
    # SIGTERM stops both ports, and the API's shutdown (the lifespan: leader work, workers) runs to its end
    tls_server.stop()
    log = tls_server.log.read_text() if tls_server.log else ""
    assert "stops leading" in log and "Traceback" not in log
    for port in (tls_server.port, tls_server.boot_port):
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_agent_reports_over_https_verified_against_the_ca(tls_server: Server, tmp_path: Path) -> None:
    srv = tls_server
    ok(srv.cli("node", "add", "gpu01"))
    agent_token = ok(srv.cli("node", "token", "gpu01")).strip().splitlines()[-1]
    ca_file = str(srv.state_dir / "tls" / "ca.crt")
    url = f"{srv.url}/boot/v1/agent/report"
    # the route answers a verified request (422: this body is no report; the token was accepted)
    with pytest.raises(SendError, match="422"):
        post_json(url, agent_token, b"{}", 10, opener=opener_for(ca_file))
    # without bcm's CA the agent does not talk to the server at all
    with pytest.raises(SendError, match="CERTIFICATE_VERIFY_FAILED"):
        post_json(url, agent_token, b"{}", 10, opener=opener_for(None))


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace (for /proc/cmdline) needs root")
def test_bcm_hello_calls_back_over_https(tls_server: Server, tmp_path: Path) -> None:
    """The overlay's bcm-hello, as rendered with TLS on, run for real: it reaches the API over https,
    verified against the CA it names (a made-up boot token: the server's 401 is the answer it gets)."""
    ca = tls_server.state_dir / "tls" / "ca.crt"
    hello = tmp_path / "bcm-hello"
    hello.write_text(
        render("overlay/usr/local/sbin/bcm-hello.j2", node="gpu01", api_url=tls_server.url, ca_file=str(ca))
    )
    cmdline = tmp_path / "cmdline"
    token = "bcmboot_" + "x" * 43
    cmdline.write_text(
        f"quiet bcm.server={tls_server.boot_url} bcm.mac=52:54:00:00:31:01 bcm.token={token}\n"
    )
    ssh_dir = tmp_path / "ssh"  # the node's /etc/ssh: the script would make host keys in an empty one
    ssh_dir.mkdir()
    (ssh_dir / "ssh_host_ed25519_key.pub").write_text(
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDummyDummyDummy node\n"
    )
    inner = f"mount --bind {cmdline} /proc/cmdline && mount --bind {ssh_dir} /etc/ssh && exec {sys.executable} {hello}"
    r = subprocess.run(["unshare", "-m", "sh", "-c", inner], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "the head node refused the callback (401)" in r.stderr, (r.stdout, r.stderr)


def _start_agent(tmp_path: Path, name: str, config: dict[str, object]) -> tuple[subprocess.Popen[str], Path]:
    """The agent zipapp as nodes run it (standard library only), with a fake NVML, logging to a file."""
    from bcm.agent.bundle import build_bundle
    from bcm.lab.fakegpu import RECORDED_NVML

    bundle, cfg, log = tmp_path / f"{name}.pyz", tmp_path / f"{name}.json", tmp_path / f"{name}.log"
    bundle.write_bytes(build_bundle())
    cfg.write_text(json.dumps({**config, "interval_s": 1}))
    cfg.chmod(0o600)
    fake = str(RECORDED_NVML / "h100_sxm_565.json")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(bundle), "--config", str(cfg), "--fake", fake],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    return proc, log


def _wait(what: str, check: object, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.3)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


def test_a_real_agent_reports_over_https_only_with_the_ca(tls_server: Server, tmp_path: Path) -> None:
    srv = tls_server
    here = socket.gethostname().split(".")[0].lower()  # the agent reports for the host it runs on
    ok(srv.cli("node", "add", f"{here},other01"))
    tokens = {n: ok(srv.cli("node", "token", n)).strip().splitlines()[-1] for n in (here, "other01")}
    api = httpx.Client(
        base_url=srv.url, verify=srv.verify(), timeout=30, headers={"Authorization": f"Bearer {srv.token()}"}
    )
    ca = str(srv.state_dir / "tls" / "ca.crt")
    trusted, trusted_log = _start_agent(
        tmp_path, "a", {"server_url": srv.url, "token": tokens[here], "ca_file": ca}
    )
    untrusting, log = _start_agent(tmp_path, "b", {"server_url": srv.url, "token": tokens["other01"]})
    try:
        _wait("the agent's GPUs arrive", lambda: api.get(f"/api/v1/nodes/{here}/gpus").json(), 90)
        assert any(g["uuid"].startswith("GPU-b42dd28e") for g in api.get(f"/api/v1/nodes/{here}/gpus").json())
        _wait(
            "the agent without bcm's CA refuses the server",
            lambda: "CERTIFICATE_VERIFY_FAILED" in log.read_text(),
        )
        assert "server refused" not in log.read_text()  # it never reached the server: nothing was sent
        assert "CERTIFICATE_VERIFY_FAILED" not in trusted_log.read_text()
    finally:
        for proc in (trusted, untrusting):
            proc.terminate()
            proc.wait(10)


def _admin_pki(tmp_path: Path) -> tuple[Path, Path, Path, x509.Certificate]:
    """What an admin brings: their CA, and a certificate and key it issued for the head."""
    now = tls.dt.datetime.now(tls.dt.UTC)
    ca, ca_key = tls.make_ca(now, "site CA")
    cert, key = tls.issue_server(ca, ca_key, ["bcm-head.test", "127.0.0.1"], now)
    pem = serialization.Encoding.PEM
    paths = tmp_path / "site.crt", tmp_path / "site.key", tmp_path / "site-ca.crt"
    paths[0].write_bytes(cert.public_bytes(pem))
    paths[1].write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    paths[1].chmod(0o600)
    paths[2].write_bytes(ca.public_bytes(pem))
    return *paths, cert


def test_admin_certificate_and_key(tmp_path: Path) -> None:
    crt, key, ca_crt, cert = _admin_pki(tmp_path)
    env = {"BCM_TLS__CERT_FILE": str(crt), "BCM_TLS__KEY_FILE": str(key), "BCM_TLS__CA_FILE": str(ca_crt)}
    srv = Server(tmp_path / "state", tls=True, extra_env=env, ca_file=ca_crt)
    srv.start()
    try:
        served = x509.load_pem_x509_certificate(ssl.get_server_certificate(("127.0.0.1", srv.port)).encode())
        assert served.serial_number == cert.serial_number
        assert not (srv.state_dir / "tls" / "ca.key").exists()  # bcm made no CA of its own
        fp = shown_fingerprint(srv)
        assert fp == tls.fingerprint(x509.load_pem_x509_certificate(ca_crt.read_bytes()))
        admin = remote(srv, tmp_path)
        ok(srv.cli("ca", "fetch", "--fingerprint", fp, **admin))
        ok(srv.cli("node", "add", "site01", **admin))
        assert json.loads(ok(srv.cli("node", "show", "site01", "--json", **admin)))["name"] == "site01"
        # on the head, with the server's settings: the admin's CA file verifies it
        assert json.loads(ok(srv.cli("node", "list", "--json")))[0]["name"] == "site01"
    finally:
        srv.stop()


def test_bad_tls_settings_are_one_line_at_start(tmp_path: Path) -> None:
    crt, key, _ca, _cert = _admin_pki(tmp_path)
    (tmp_path / "other").mkdir()
    _crt2, other_key, _ca2, _cert2 = _admin_pki(tmp_path / "other")
    srv = Server(tmp_path / "state", tls=True)
    never = {"BCM_STATE_DIR": str(tmp_path / "never")}
    missing = str(tmp_path / "missing.key")
    failed_with(
        srv.cli("serve", **never, BCM_TLS__CERT_FILE=str(crt), BCM_TLS__KEY_FILE=missing),
        "BCM_TLS__KEY_FILE",
        "cannot read",
        "missing.key",
    )
    failed_with(
        srv.cli("serve", **never, BCM_TLS__CERT_FILE=str(crt), BCM_TLS__KEY_FILE=str(other_key)),
        "BCM_TLS__KEY_FILE",
        "is not the key of the certificate",
    )
    failed_with(srv.cli("serve", **never, BCM_TLS__CERT_FILE=str(crt)), "BCM_TLS__KEY_FILE", "go together")
    failed_with(
        srv.cli("serve", **never, BCM_TLS__CERT_FILE=str(key), BCM_TLS__KEY_FILE=str(key)),
        "BCM_TLS__CERT_FILE",
        "not a PEM certificate",
    )
    assert not (tmp_path / "never").exists()  # nothing was started
    failed_with(srv.cli("ca", "show", **never), "no CA in", "BCM_TLS__ENABLED=true")
    # the boot port taken: one line too
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        failed_with(
            srv.cli("serve", **never, BCM_TLS__BOOT_PORT=port), "BCM_TLS__BOOT_PORT", "cannot listen", port
        )
    assert not (tmp_path / "never").exists()
