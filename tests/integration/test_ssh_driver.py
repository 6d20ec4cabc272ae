"""bcm.drivers.ssh against a real OpenSSH sshd on 127.0.0.1.

sshd runs in its own mount namespace where a temporary directory is bind-mounted over /root
(so keys installed by the tests never touch the real root account, and no shell start-up file
runs) and a copy of /etc/shadow with a test password for root is bind-mounted over /etc/shadow.
Needs root (sshd privilege separation, mount namespace); skipped otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import socket
import stat
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bcm.agent.facts import FACT_SCRIPT
from bcm.domain.facts import parse_fact_output
from bcm.drivers.ssh import (
    HostResult,
    HostStatus,
    RemoteFile,
    SshClient,
    Target,
    ensure_keypair,
    install_public_key,
    install_public_key_many,
)
from bcm.errors import FatalDriverError, RetryableDriverError

pytestmark = pytest.mark.integration

SSHD = Path("/usr/sbin/sshd")
ROOT_PASSWORD = "bcm-test-password"  # only valid inside the test sshd's mount namespace


@dataclass
class Sshd:
    port: int
    host_key: str  # OpenSSH line, no comment
    client_key: Path
    home: Path
    log: Path

    def target(self, name: str = "local", pinned: str | None = None) -> Target:
        return Target(name=name, address="127.0.0.1", port=self.port, pinned_host_key=pinned)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _key_line(pub_file: Path) -> str:
    return " ".join(pub_file.read_text().split()[:2])


def _shadow_with_root_password(dest: Path) -> None:
    hashed = subprocess.run(
        ["openssl", "passwd", "-6", ROOT_PASSWORD], capture_output=True, text=True, check=True
    ).stdout.strip()
    lines = []
    for line in Path("/etc/shadow").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == "root":
            fields[1] = hashed
        lines.append(":".join(fields))
    dest.write_text("\n".join(lines) + "\n")
    dest.chmod(0o600)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    if os.geteuid() != 0:
        pytest.skip("needs root to run sshd")
    if not SSHD.exists() or not shutil.which("unshare") or not shutil.which("openssl"):
        pytest.skip("needs /usr/sbin/sshd, unshare and openssl")
    d = tmp_path_factory.mktemp("sshd")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_ed25519")], check=True)
    home = d / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    client_key = d / "client" / "id_ed25519"
    (home / ".ssh" / "authorized_keys").write_text(ensure_keypair(client_key) + "\n")
    _shadow_with_root_password(d / "shadow")
    port = _free_port()
    (d / "sshd_config").write_text(
        f"""ListenAddress 127.0.0.1
Port {port}
HostKey {d / "host_ed25519"}
PidFile none
UsePAM no
StrictModes no
PermitRootLogin yes
PubkeyAuthentication yes
PasswordAuthentication yes
KbdInteractiveAuthentication no
AuthorizedKeysFile .ssh/authorized_keys
UseDNS no
MaxStartups 100
MaxSessions 100
Subsystem sftp internal-sftp
LogLevel VERBOSE
"""
    )
    # A tmpfs /run gives sshd its privilege-separation directory without creating it on the host.
    inner = (
        "mount -t tmpfs tmpfs /run && mkdir -p /run/sshd && "
        f"mount --bind {d / 'shadow'} /etc/shadow && mount --bind {home} /root && "
        f"exec {SSHD} -D -e -f {d / 'sshd_config'}"
    )
    log = d / "sshd.log"
    with log.open("wb") as log_fh:
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
            stdout=log_fh,
            stderr=subprocess.STDOUT,
        )
    try:
        for _ in range(200):  # up to ~10 s for sshd to listen
            if proc.poll() is not None:
                pytest.fail(f"sshd exited {proc.returncode}: {log.read_text()}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        else:
            pytest.fail(f"sshd did not listen on {port}: {log.read_text()}")
        yield Sshd(port, _key_line(d / "host_ed25519.pub"), client_key, home, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def client(sshd: Sshd) -> SshClient:
    return SshClient(sshd.client_key, username="root", connect_timeout_s=5, command_timeout_s=30)


class SilentListener:
    """Accepts TCP connections and never says a word, like an sshd wedged after accept."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


class ResettingProxy:
    """Forwards TCP to sshd, but resets the first ``drops`` connections (an overloaded sshd does that)."""

    def __init__(self, backend_port: int, drops: int) -> None:
        self.backend_port = backend_port
        self.drops = drops
        self.accepted = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.accepted <= self.drops:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()  # RST: "connection reset by peer"
                continue
            backend = socket.create_connection(("127.0.0.1", self.backend_port), timeout=10)
            backend.settimeout(None)
            for a, b in ((conn, backend), (backend, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()


def run(coro):  # type: ignore[no-untyped-def]
    # Outer bound: a driver that failed to bound a host would hang the test; this fails it instead.
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_ok_command_returns_output_and_pins_on_first_contact(sshd: Sshd, client: SshClient) -> None:
    [result] = run(client.run_many([sshd.target()], "echo hello; echo warn >&2"))
    assert result.status is HostStatus.OK, result.error
    assert result.exit_status == 0
    assert result.stdout == "hello\n"
    assert result.stderr == "warn\n"
    assert result.host_key == sshd.host_key


def test_pinned_matching_key_connects(sshd: Sshd, client: SshClient) -> None:
    result = run(client.run_one(sshd.target(pinned=sshd.host_key), "true"))
    assert result.status is HostStatus.OK, result.error
    assert result.host_key == sshd.host_key


def test_changed_host_key_is_refused_before_the_command_runs(
    sshd: Sshd, client: SshClient, tmp_path: Path
) -> None:
    other_key = ensure_keypair(tmp_path / "other" / "id_ed25519")
    marker = tmp_path / "marker"
    result = run(client.run_one(sshd.target(pinned=other_key), f"touch {marker}"))
    assert result.status is HostStatus.HOST_KEY_CHANGED
    assert result.host_key == sshd.host_key  # the key seen, for the operator to compare
    assert not marker.exists()
    with pytest.raises(FatalDriverError):
        result.raise_for_status()


def test_malformed_pin_is_refused(sshd: Sshd, client: SshClient, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    result = run(client.run_one(sshd.target(pinned="ssh-ed25519 not-base64!"), f"touch {marker}"))
    assert result.status is HostStatus.HOST_KEY_CHANGED
    assert not marker.exists()


def test_unknown_client_key_is_auth_failed(sshd: Sshd, tmp_path: Path) -> None:
    stranger = tmp_path / "stranger" / "id_ed25519"
    ensure_keypair(stranger)
    result = run(SshClient(stranger, connect_timeout_s=5).run_one(sshd.target(), "true"))
    assert result.status is HostStatus.AUTH_FAILED
    assert result.host_key == sshd.host_key


def test_nonzero_exit_is_command_failed_with_stderr(sshd: Sshd, client: SshClient) -> None:
    result = run(client.run_one(sshd.target(), "echo partial; echo 'disk on fire' >&2; exit 3"))
    assert result.status is HostStatus.COMMAND_FAILED
    assert result.exit_status == 3
    assert result.stdout == "partial\n"
    assert result.stderr == "disk on fire\n"
    assert result.error is not None and "disk on fire" in result.error


def test_command_timeout_keeps_partial_output(sshd: Sshd, client: SshClient) -> None:
    result = run(client.run_one(sshd.target(), "echo started; sleep 60", command_timeout=1))
    assert result.status is HostStatus.TIMED_OUT
    assert result.stdout == "started\n"
    with pytest.raises(RetryableDriverError):
        result.raise_for_status()


def test_batch_with_dead_and_silent_hosts_still_succeeds_elsewhere(sshd: Sshd, client: SshClient) -> None:
    silent = SilentListener()
    closed_port = _free_port()
    hosts = [
        sshd.target("good1"),
        Target("silent", "127.0.0.1", silent.port),
        Target("closed", "127.0.0.1", closed_port),
        sshd.target("good2"),
    ]
    seen: list[str] = []

    async def record(result: HostResult) -> None:
        seen.append(result.name)

    try:
        results = run(
            client.run_many(
                hosts, "hostname", concurrency=2, connect_timeout=1, command_timeout=2, on_result=record
            )
        )
    finally:
        silent.close()
    by_name = {r.name: r for r in results}
    assert [r.name for r in results] == ["good1", "silent", "closed", "good2"]  # input order
    assert sorted(seen) == sorted(by_name)  # each reported exactly once
    assert by_name["good1"].status is HostStatus.OK
    assert by_name["good2"].status is HostStatus.OK
    assert by_name["good1"].stdout.strip() == socket.gethostname()
    assert by_name["silent"].status is HostStatus.TIMED_OUT
    assert by_name["silent"].host_key is None
    assert by_name["closed"].status is HostStatus.UNREACHABLE
    # the dead hosts were tried again (bounded: 1 + 3 retries at most, within the batch's deadline)
    assert by_name["good1"].attempts == by_name["good2"].attempts == 1
    for name in ("silent", "closed"):
        assert 2 <= by_name[name].attempts <= 4, by_name[name]
        assert f"after {by_name[name].attempts} attempts" in (by_name[name].error or "")


def test_reset_connections_are_retried_until_the_host_answers(sshd: Sshd, tmp_path: Path) -> None:
    proxy = ResettingProxy(sshd.port, drops=2)
    client = SshClient(sshd.client_key, connect_timeout_s=5, retries=3, backoff_s=0.05, rng=random.Random(3))
    try:
        [result] = run(client.run_many([Target("flaky", "127.0.0.1", proxy.port, sshd.host_key)], "echo up"))
    finally:
        proxy.close()
    assert result.status is HostStatus.OK, result.error
    assert result.stdout == "up\n"
    assert result.attempts == 3 and proxy.accepted == 3  # two resets, then the login
    assert [e.split(":")[0] for e in result.earlier] == ["unreachable", "unreachable"]


def test_retries_are_bounded_for_a_host_that_stays_down(sshd: Sshd) -> None:
    proxy = ResettingProxy(sshd.port, drops=100)
    client = SshClient(sshd.client_key, connect_timeout_s=5, retries=2, backoff_s=0.05)
    try:
        [result] = run(client.run_many([Target("down", "127.0.0.1", proxy.port)], "true"))
    finally:
        proxy.close()
    assert result.status is HostStatus.UNREACHABLE
    assert result.attempts == 3 and proxy.accepted == 3
    assert "after 3 attempts" in (result.error or "")


def test_definite_failures_are_not_retried(sshd: Sshd, client: SshClient, tmp_path: Path) -> None:
    stranger = tmp_path / "stranger" / "id_ed25519"
    ensure_keypair(stranger)
    other_key = ensure_keypair(tmp_path / "other" / "id_ed25519")
    marker = tmp_path / "ran"
    auth = run(SshClient(stranger, connect_timeout_s=5).run_many([sshd.target()], "true"))[0]
    assert auth.status is HostStatus.AUTH_FAILED and auth.attempts == 1
    changed = run(client.run_many([sshd.target(pinned=other_key)], "true"))[0]
    assert changed.status is HostStatus.HOST_KEY_CHANGED and changed.attempts == 1 and not changed.earlier
    failed = run(client.run_many([sshd.target()], f"echo x >> {marker}; exit 4"))[0]
    assert failed.status is HostStatus.COMMAND_FAILED and failed.attempts == 1
    assert marker.read_text() == "x\n"  # ran once
    slow = run(client.run_many([sshd.target()], f"echo y >> {marker}; sleep 30", command_timeout=1))[0]
    assert slow.status is HostStatus.TIMED_OUT and slow.attempts == 1  # a command that ran is never run again
    assert marker.read_text() == "x\ny\n"


def test_on_result_error_propagates(sshd: Sshd, client: SshClient) -> None:
    def boom(result: HostResult) -> None:
        raise RuntimeError("progress bar broke")

    with pytest.raises(RuntimeError, match="progress bar broke"):
        run(client.run_many([sshd.target("a"), sshd.target("b")], "true", on_result=boom))


def test_fact_script_through_the_driver_matches_this_machine(sshd: Sshd, client: SshClient) -> None:
    result = run(client.run_one(sshd.target(), FACT_SCRIPT))
    assert result.status is HostStatus.OK, result.error
    facts = parse_fact_output(result.stdout)
    assert facts.format_version == 1
    assert facts.hostname == socket.gethostname()
    mem_kib = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    assert facts.memory_bytes == mem_kib * 1024
    assert facts.kernel == os.uname().release
    assert facts.cpu.threads == os.cpu_count()


def test_put_files_writes_content_and_mode(sshd: Sshd, client: SshClient, tmp_path: Path) -> None:
    # Loopback: the "remote" filesystem is this one, so the result can be read back directly.
    script = tmp_path / "deploy" / "bin" / "agent.sh"
    config = tmp_path / "deploy" / "etc" / "agent.toml"
    result = run(
        client.put_files(
            sshd.target(),
            {str(script): RemoteFile(b"#!/bin/sh\necho hi\n", 0o755), str(config): b"token = 'x'\n\0binary"},
        )
    )
    assert result.status is HostStatus.OK, result.error
    assert script.read_bytes() == b"#!/bin/sh\necho hi\n"
    assert stat.S_IMODE(script.stat().st_mode) == 0o755
    assert config.read_bytes() == b"token = 'x'\n\0binary"
    assert stat.S_IMODE(config.stat().st_mode) == 0o644
    assert not list(script.parent.glob("*.bcm-tmp"))


def test_install_public_key_with_password_is_idempotent(sshd: Sshd, tmp_path: Path) -> None:
    new_key_path = tmp_path / "trusted" / "id_ed25519"
    new_key = ensure_keypair(new_key_path)
    for _ in range(2):
        result = run(install_public_key(sshd.target(), ROOT_PASSWORD, new_key + " operator@laptop"))
        assert result.status is HostStatus.OK, result.error
        assert result.host_key == sshd.host_key
    lines = (sshd.home / ".ssh" / "authorized_keys").read_text().splitlines()
    assert lines.count(new_key) == 1
    after = run(SshClient(new_key_path, connect_timeout_s=5).run_one(sshd.target(), "echo in"))
    assert after.status is HostStatus.OK, after.error


def test_install_public_key_many_goes_through_the_fan_out(sshd: Sshd, tmp_path: Path) -> None:
    new_key = ensure_keypair(tmp_path / "many" / "id_ed25519")
    closed = Target("closed", "127.0.0.1", _free_port())
    results = run(
        install_public_key_many(
            [sshd.target("a"), sshd.target("b"), closed], ROOT_PASSWORD, new_key, retries=1, backoff_s=0.05
        )
    )
    assert [(r.name, r.status, r.attempts) for r in results] == [
        ("a", HostStatus.OK, 1),
        ("b", HostStatus.OK, 1),
        ("closed", HostStatus.UNREACHABLE, 2),
    ]
    assert (sshd.home / ".ssh" / "authorized_keys").read_text().splitlines().count(new_key) == 1


def test_install_public_key_wrong_password_is_auth_failed(sshd: Sshd, tmp_path: Path) -> None:
    new_key = ensure_keypair(tmp_path / "k" / "id_ed25519")
    result = run(install_public_key(sshd.target(), "not-the-password", new_key))
    assert result.status is HostStatus.AUTH_FAILED
    assert "not-the-password" not in (result.error or "")
    assert new_key not in (sshd.home / ".ssh" / "authorized_keys").read_text()


def test_install_public_key_refuses_changed_host_key(sshd: Sshd, tmp_path: Path) -> None:
    other_host_key = ensure_keypair(tmp_path / "other" / "id_ed25519")
    new_key = ensure_keypair(tmp_path / "k" / "id_ed25519")
    result = run(install_public_key(sshd.target(pinned=other_host_key), ROOT_PASSWORD, new_key))
    assert result.status is HostStatus.HOST_KEY_CHANGED
    assert new_key not in (sshd.home / ".ssh" / "authorized_keys").read_text()


def test_ensure_keypair_creates_private_files_once(tmp_path: Path) -> None:
    path = tmp_path / "state" / "ssh" / "id_ed25519"
    first = ensure_keypair(path)
    assert first.startswith("ssh-ed25519 ")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert _key_line(path.with_name("id_ed25519.pub")) == first
    assert ensure_keypair(path) == first


def test_many_hosts_under_a_small_concurrency_cap(sshd: Sshd, client: SshClient) -> None:
    hosts = [sshd.target(f"n{i:03d}", pinned=sshd.host_key) for i in range(40)]
    progress: list[str] = []
    in_flight = peak = 0
    inner = client._with_connection

    async def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await inner(*args, **kwargs)
        finally:
            in_flight -= 1

    client._with_connection = counting  # type: ignore[method-assign]
    results = run(
        client.run_many(hosts, "echo $((6 * 7))", concurrency=8, on_result=lambda r: progress.append(r.name))
    )
    assert [r.name for r in results] == [h.name for h in hosts]
    assert {r.status for r in results} == {HostStatus.OK}
    assert {r.stdout for r in results} == {"42\n"}
    assert sorted(progress) == sorted(h.name for h in hosts)
    assert 1 < peak <= 8


def test_node_trust_then_inventory_through_the_server(sshd: Sshd, tmp_path: Path) -> None:
    """`bcm node trust --password-stdin` installs the server's key; inventory then logs in with it."""
    from bcm.devserver import Server

    srv = Server(
        tmp_path / "state", extra_env={"BCM_SSH__PORT": str(sshd.port), "BCM_SSH__CONNECT_TIMEOUT_S": "5"}
    )
    srv.start()
    try:
        assert srv.cli("node", "add", "local1", "--ip", "127.0.0.1").returncode == 0
        before = srv.cli("node", "inventory", "local1", "--json")
        assert (
            before.returncode == 1 and '"auth_failed"' in before.stdout
        )  # the server's key is not trusted yet
        wrong = srv.cli("node", "trust", "local1", "--password-stdin", input="not-the-password\n")
        assert wrong.returncode == 1 and "auth_failed" in wrong.stdout
        res = srv.cli("node", "trust", "local1", "--password-stdin", "--json", input=ROOT_PASSWORD + "\n")
        assert res.returncode == 0, res.stdout + res.stderr
        assert ROOT_PASSWORD not in (srv.log.read_text() if srv.log else "")
        after = srv.cli("node", "inventory", "local1", "--json")
        assert after.returncode == 0, after.stdout + after.stderr
        pub = (srv.state_dir / "ssh" / "id_ed25519.pub").read_text().split()[:2]
        assert " ".join(pub) in (sshd.home / ".ssh" / "authorized_keys").read_text()
    finally:
        srv.stop()
