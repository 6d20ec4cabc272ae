"""One lab node: its record, its files in the overlay's upper layer, and the sshd process tree.

A node is `nsenter --net=<netns> unshare --mount --uts --pid --fork --kill-child sh -c <script>`; the
script mounts the overlay root, proc, sysfs, /dev and a /run tmpfs in the private mount namespace,
sets the hostname and becomes `chroot <root> sshd -D -e`, which is PID 1 of the node's PID
namespace, so every session dies with it. `nsenter --net` rather than `ip netns exec`: the latter
remounts /sys and hides /sys/fs/cgroup, which slurmd needs later (see LAB.md).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bcm.lab import procs
from bcm.lab.errors import LabError

HOST_KEY = "etc/ssh/ssh_host_ed25519_key"
SSHD_CONFIG = """\
# Written by bcm.lab for a lab node.
Port 22
HostKey /etc/ssh/ssh_host_ed25519_key
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
UseDNS no
PrintMotd no
MaxSessions 64
MaxStartups 64:30:256
AcceptEnv LANG LC_*
Subsystem sftp internal-sftp
"""
NODE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class LabNode:
    """A lab node as recorded in the state file, plus whether its sshd runs now.

    ``rootfs`` is the node's root mount point; the overlay is mounted there only inside the node's
    own mount namespace, so from the host read it through ``/proc/<sshd_pid>/root`` (``root_view``).
    """

    name: str
    index: int
    netns: str
    mac: str
    ip: str
    host_key_public: str
    rootfs: str
    upper: str
    sshd_pid: int | None = None
    sshd_started: int | None = None
    parent_pid: int | None = None
    alive: bool = False
    frozen: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def root_view(self) -> Path | None:
        """The node's root filesystem as the host sees it, while sshd runs."""
        return Path(f"/proc/{self.sshd_pid}/root") if self.alive else None

    def known_hosts_line(self) -> str:
        """A known_hosts entry pinning this node's host key to its name and address."""
        key_type, key = self.host_key_public.split()[:2]
        return f"{self.name},{self.ip} {key_type} {key}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LabNode:
        return cls(**data)

    def refresh(self) -> LabNode:
        """Recompute alive/frozen from /proc."""
        self.alive = procs.is_alive(self.sshd_pid, self.sshd_started)
        self.frozen = self.alive and self.sshd_pid is not None and procs.is_stopped(self.sshd_pid)
        return self


@dataclass(frozen=True)
class NodeDirs:
    """Where a node's files live under the lab state dir."""

    base: Path

    @property
    def upper(self) -> Path:
        return self.base / "upper"

    @property
    def work(self) -> Path:
        return self.base / "work"

    @property
    def root(self) -> Path:
        return self.base / "root"

    @property
    def keys(self) -> Path:
        return self.base / "keys"

    @property
    def log(self) -> Path:
        return self.base / "sshd.log"

    def make(self) -> None:
        for sub in (self.upper, self.work, self.root, self.keys):
            sub.mkdir(parents=True, exist_ok=True)
        self.keys.chmod(0o700)


def generate_host_key(dirs: NodeDirs, hostname: str) -> str:
    """Make a fresh ed25519 host key on the host and return its public OpenSSH line."""
    key = dirs.keys / "ssh_host_ed25519_key"
    for old in (key, key.with_suffix(".pub")):
        old.unlink(missing_ok=True)
    procs.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{hostname}", "-f", str(key)])
    return key.with_suffix(".pub").read_text().strip()


def install_host_key(dirs: NodeDirs) -> None:
    """Copy the host's copy of the key into the upper layer (only while the overlay is unmounted)."""
    target = dirs.upper / HOST_KEY
    target.parent.mkdir(parents=True, exist_ok=True)
    key = dirs.keys / "ssh_host_ed25519_key"
    _write(target, key.read_text(), 0o600)
    _write(target.with_name(target.name + ".pub"), key.with_suffix(".pub").read_text(), 0o644)


def write_node_files(dirs: NodeDirs, hostname: str, authorized_keys: list[str], hosts: str) -> None:
    """The per-node files: sshd config, root's authorized keys, hostname and hosts."""
    _write(dirs.upper / "etc/ssh/sshd_config", SSHD_CONFIG, 0o644)
    ssh_dir = dirs.upper / "root/.ssh"
    ssh_dir.mkdir(parents=True, exist_ok=True)
    ssh_dir.chmod(0o700)
    _write(ssh_dir / "authorized_keys", "".join(k.strip() + "\n" for k in authorized_keys), 0o600)
    _write(dirs.upper / "etc/hostname", hostname + "\n", 0o644)
    _write(dirs.upper / "etc/hosts", hosts, 0o644)


def _write(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    os.replace(tmp, path)


def start_script(lower: Path, dirs: NodeDirs, hostname: str) -> str:
    """The shell script run inside the new mount, UTS and PID namespaces; it ends as sshd."""
    q = shlex.quote
    root = q(str(dirs.root))
    overlay_opts = f"lowerdir={lower},upperdir={dirs.upper},workdir={dirs.work}"
    return "; ".join(
        [
            "set -e",
            # No router adverts either: a head running dnsmasq with enable-ra must not give nodes a
            # default IPv6 route (this /proc/sys/net belongs to the node's network namespace).
            "for f in /proc/sys/net/ipv6/conf/*/accept_ra; do echo 0 > $f 2>/dev/null || true; done",
            f"mount -t overlay overlay -o {q(overlay_opts)} {root}",
            f"mount -t proc -o nosuid,nodev,noexec proc {root}/proc",
            f"mount -t sysfs -o nosuid,nodev,noexec sysfs {root}/sys",
            # cgroups for slurmd; the fresh sysfs has an empty fs/cgroup to mount on.
            f"if [ -d /sys/fs/cgroup ]; then mount --rbind /sys/fs/cgroup {root}/sys/fs/cgroup; fi",
            f"mount --rbind /dev {root}/dev",
            f"mount -t tmpfs -o mode=0755,nosuid,nodev,size=64m tmpfs {root}/run",
            f"mkdir -p {root}/run/sshd {root}/run/lock",
            f"hostname {q(hostname)}",
            f"exec chroot {root} /usr/sbin/sshd -D -e",
        ]
    )


def spawn(netns: str, script: str, log: Path) -> subprocess.Popen[bytes]:
    """Start the node's process tree; it outlives this Python process (own session, no pipes)."""
    argv = [
        "nsenter",
        f"--net=/run/netns/{netns}",
        "unshare",
        "--mount",
        "--uts",
        "--pid",
        "--fork",
        "--kill-child",
        "sh",
        "-c",
        script,
    ]
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={"PATH": NODE_PATH, "LANG": "C.UTF-8", "HOME": "/root"},
        )


def sshd_of(parent_pid: int) -> int | None:
    """The sshd under an unshare parent, once its child has exec'd sshd and listens on port 22."""
    for child in procs.children(parent_pid):
        if procs.comm(child) == "sshd" and procs.listening_on(child, 22):
            return child
    return None


def exec_argv(node: LabNode, argv: list[str]) -> list[str]:
    """Command line running argv inside the node: its mount, UTS, net and PID namespaces and root."""
    if not node.alive or node.sshd_pid is None:
        raise LabError(f"lab node {node.name} is not running; start it first")
    return [
        "nsenter",
        f"--target={node.sshd_pid}",
        "--mount",
        "--uts",
        "--net",
        "--pid",
        "--root",
        "--wd",
        "env",
        "-i",
        f"PATH={NODE_PATH}",
        "HOME=/root",
        "LANG=C.UTF-8",
        *argv,
    ]


def log_tail(dirs: NodeDirs, limit: int = 1500) -> str:
    try:
        return dirs.log.read_text(errors="replace")[-limit:]
    except FileNotFoundError:
        return ""


def remove_dirs(dirs: NodeDirs) -> None:
    """Delete a node's files; refuses while anything is mounted below (a stray /dev bind, say)."""
    if procs.mounts_under(dirs.base):
        raise LabError(f"refusing to delete {dirs.base}: something is still mounted below it")
    shutil.rmtree(dirs.base, ignore_errors=False)
