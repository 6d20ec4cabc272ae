"""Slurm accounting for a lab: the host's MariaDB, shared with the lab nodes through its unix socket.

- MariaDB runs on the host (root over its unix socket, no password). ``ensure_mariadb`` starts it when
  it is installed but down (no systemd here), and says how to install it when it is absent.
- Each lab gets its own database and user (``AccountingDb.for_lab``) with a random password, kept in
  ``<lab state dir>/slurm-accounting.pass`` (0600) and handed to MariaDB on stdin, never on a command
  line. ``bcm lab down`` drops both.
- slurmdbd on whichever node becomes the controller reaches MariaDB through the socket: the host's
  ``/run/mysqld`` is bind-mounted into every node's root inside the node's own mount namespace
  (namespaces do not hide a unix socket; the node's ``/run`` is a private tmpfs, hence the bind).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bcm.lab import fakegpu
from bcm.lab.errors import LabError
from bcm.lab.node import LabNode

MYSQL_SOCKET = Path("/run/mysqld/mysqld.sock")
MARIADBD = Path("/usr/sbin/mariadbd")
PASS_FILE = "slurm-accounting.pass"  # noqa: S105 - a file name, not a password
SETTINGS_FILE = "slurm.json"
START_TIMEOUT_S = 60.0
# Lab-only Slurm settings (LAB.md): no cgroup process tracking in the nested namespaces, nodes may
# declare what their facts say even where the machine is shared, simulated devices outside /dev.
LAB_SLURM_SETTINGS: dict[str, object] = {
    "proctrack_type": "proctrack/linuxproc",
    "task_plugin": "task/none",
    "jobacct_gather_type": "jobacct_gather/linux",
    "slurmd_parameters": "config_overrides",
    "gpu_device_dir": fakegpu.DEVICE_DIR,
    "constrain_devices": False,
}


def _run(argv: list[str], timeout: float = 120, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=stdin, check=False)
    except FileNotFoundError as exc:
        raise LabError(f"{argv[0]} is not installed (apt-get install mariadb-client)") from exc
    if done.returncode != 0:
        raise LabError(
            f"{shlex.join(argv[:6])} failed ({done.returncode}): {(done.stderr or done.stdout)[-1500:]}"
        )
    return done


def _socket_answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(2)
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False


def mariadb_installed() -> bool:
    return MARIADBD.exists() or shutil.which("mariadbd") is not None


def ensure_mariadb(timeout_s: float = START_TIMEOUT_S) -> None:
    """Start the host's MariaDB if its socket does not answer (bounded wait); LabError if not installed."""
    if _socket_answers(MYSQL_SOCKET):
        return
    if not mariadb_installed():
        raise LabError(
            "MariaDB is not installed on this machine; Slurm accounting in the lab needs it: "
            "apt-get install mariadb-server, then `bcm lab up` again"
        )
    Path("/run/mysqld").mkdir(exist_ok=True)
    shutil.chown("/run/mysqld", "mysql", "mysql")
    _run(
        [
            "start-stop-daemon",
            "--start",
            "--quiet",
            "--oknodo",
            "--background",
            "--chuid",
            "mysql:mysql",
            "--pidfile",
            "/run/mysqld/mysqld.pid",
            "--exec",
            str(MARIADBD),
            "--",
            "--pid-file=/run/mysqld/mysqld.pid",
            f"--socket={MYSQL_SOCKET}",
        ]
    )
    deadline = time.monotonic() + timeout_s
    while not _socket_answers(MYSQL_SOCKET):  # bounded by timeout_s
        if time.monotonic() > deadline:
            raise LabError(f"MariaDB did not open {MYSQL_SOCKET} within {timeout_s:.0f}s")
        time.sleep(0.3)


def sql(statements: str) -> str:
    """Run SQL as MariaDB's root over the socket; statements (and any password) travel on stdin."""
    argv = ["mysql", "--protocol=socket", f"--socket={MYSQL_SOCKET}", "-uroot", "--batch", "-N"]
    return _run(argv, stdin=statements).stdout


def databases() -> list[str]:
    return sql("SHOW DATABASES;\n").split()


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    tmp.replace(path)


@dataclass
class AccountingDb:
    """A database and a user of its own for one lab's slurmdbd; ``drop()`` removes both."""

    name: str
    user: str
    password: str

    @classmethod
    def for_lab(cls, lab_name: str, state_dir: Path) -> AccountingDb:
        """Recreate the lab's database, empty, and its user with a fresh password, written 0600 to the
        state dir. A database left by an earlier lab of the same name (a run killed before `bcm lab down`)
        is dropped: its accounts and associations would show in the new lab's Slurm as someone's edits."""
        ensure_mariadb()
        tag = re.sub(r"[^a-z0-9]", "_", lab_name)
        db = cls(f"bcm_{tag}_acct", f"bcm_{tag}_slurm"[:80], secrets.token_urlsafe(24))
        sql(
            f"DROP DATABASE IF EXISTS `{db.name}`;\n"
            f"CREATE DATABASE `{db.name}`;\n"
            f"CREATE USER IF NOT EXISTS '{db.user}'@'localhost';\n"
            f"ALTER USER '{db.user}'@'localhost' IDENTIFIED BY '{db.password}';\n"
            f"GRANT ALL ON `{db.name}`.* TO '{db.user}'@'localhost';\n"
        )
        _write_private(state_dir / PASS_FILE, db.password + "\n")
        return db

    @classmethod
    def of_lab(cls, state_dir: Path) -> AccountingDb | None:
        """The lab's database as recorded in its state dir, or None."""
        try:
            data = json.loads((state_dir / SETTINGS_FILE).read_text())
            password = (state_dir / PASS_FILE).read_text().strip()
        except (OSError, ValueError):
            return None
        return cls(data["settings"]["storage_loc"], data["settings"]["storage_user"], password)

    def drop(self) -> None:
        sql(f"DROP DATABASE IF EXISTS `{self.name}`;\nDROP USER IF EXISTS '{self.user}'@'localhost';\n")


def share_mysql_socket(node: LabNode) -> None:
    """Bind the host's /run/mysqld into the node's root (inside its mount namespace); idempotent."""
    if not node.alive or node.sshd_pid is None:
        raise LabError(f"lab node {node.name} is not running")
    target = shlex.quote(f"{node.rootfs}/run/mysqld")
    script = f"mkdir -p {target} && {{ mountpoint -q {target} || mount --bind /run/mysqld {target}; }}"
    _run(["nsenter", f"--target={node.sshd_pid}", "--mount", "sh", "-c", script])


def write_slurm_defaults(state_dir: Path, nodes: list[str], settings: dict[str, Any]) -> None:
    """What `bcm wlm deploy slurm` adds for a cluster made of this lab's nodes (no secret in it)."""
    _write_private(state_dir / SETTINGS_FILE, json.dumps({"nodes": nodes, "settings": settings}, indent=2))


def add_slurm_nodes(state_dir: Path, nodes: list[str]) -> bool:
    """Count ``nodes`` (a lab VM that became a node) among the lab's own for a Slurm deploy; False when
    the lab recorded no Slurm settings."""
    path = state_dir / SETTINGS_FILE
    if not path.exists():
        return False
    data = json.loads(path.read_text())
    data["nodes"] = list(dict.fromkeys([*data["nodes"], *nodes]))
    _write_private(path, json.dumps(data, indent=2))
    return True


def slurm_defaults(state_dir: Path) -> tuple[list[str], dict[str, Any], str | None]:
    """(lab node names, Slurm settings, accounting password) recorded by ``bcm lab up``."""
    data = json.loads((state_dir / SETTINGS_FILE).read_text())
    try:
        password: str | None = (state_dir / PASS_FILE).read_text().strip()
    except FileNotFoundError:
        password = None
    return list(data["nodes"]), dict(data["settings"]), password
