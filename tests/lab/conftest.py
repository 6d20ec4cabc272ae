"""Fixtures for lab tests: a session-wide factory of real SSH-node labs, torn down in every case.

    def test_x(lab, lab_keypair, lab_ssh, tmp_path):
        built = lab(8, [lab_keypair.public])     # a bcm.lab.Lab with 8 nodes up; same name again = rebuilt
        (tmp_path / "kh").write_text(built.known_hosts())
        lab_ssh(built.node("node01").ip, "hostname", tmp_path / "kh")

Labs made here use subnets 198.18.1.0/24 and up, so a developer's own `bcmlab` on 198.18.0.0/24
keeps running beside the tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bcm.lab import Lab, net

TOOLS = ("ip", "nsenter", "unshare", "ssh", "ssh-keygen", "mmdebstrap")


def lab_unavailable() -> str | None:
    """Why lab tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "lab tests need root (network namespaces, mounts)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"lab tests need {', '.join(missing)} installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"`ip netns` is unavailable: {probe.stderr.strip()}"
    return None


@dataclass(frozen=True)
class KeyPair:
    private: Path
    public: str


@pytest.fixture(scope="session")
def lab_keypair(tmp_path_factory: pytest.TempPathFactory) -> KeyPair:
    """A throwaway ed25519 client key pair for logging in to lab nodes as root."""
    key = tmp_path_factory.mktemp("lab-client") / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    return KeyPair(private=key, public=key.with_suffix(".pub").read_text().strip())


LabFactory = Callable[..., Lab]


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabFactory]:
    """Factory: ``lab(n, authorized_keys, name="bcmtest", subnet="198.18.1.0/24") -> Lab`` (nodes up)."""
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    net.keep_lab_space_local()  # before any lab address is used
    made: dict[str, Lab] = {}

    def make(n: int, authorized_keys: list[str], name: str = "bcmtest", subnet: str = "198.18.1.0/24") -> Lab:
        if name not in made:
            made[name] = Lab(tmp_path_factory.mktemp(name), name, subnet=subnet)
        made[name].up(n, authorized_keys)
        return made[name]

    try:
        yield make
    finally:
        for built in made.values():
            built.down()


@pytest.fixture
def lab_required() -> None:
    """Skip the test unless a lab can be built here; lab addresses never leave this machine."""
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    net.keep_lab_space_local()


LabSsh = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture(scope="session")
def lab_ssh(lab_keypair: KeyPair) -> LabSsh:
    """``lab_ssh(address, command, known_hosts, timeout_s=10)``: run one command as root with real ssh."""

    def run(
        address: str, command: str, known_hosts: Path, timeout_s: int = 10
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ssh_argv(lab_keypair.private, known_hosts, address, command, timeout_s),
            capture_output=True,
            text=True,
            timeout=60 + timeout_s,
            check=False,
        )

    return run


def ssh_argv(key: Path, known_hosts: Path, address: str, command: str, timeout_s: int = 10) -> list[str]:
    """The real OpenSSH client, verifying the node's pre-registered host key."""
    return [
        "ssh",
        "-i",
        str(key),
        "-o",
        f"UserKnownHostsFile={known_hosts}",
        "-o",
        "GlobalKnownHostsFile=/dev/null",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "BatchMode=yes",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        f"ConnectTimeout={timeout_s}",
        "-F",
        "/dev/null",
        f"root@{address}",
        command,
    ]
