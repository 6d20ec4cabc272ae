"""Lab support for Slurm: the host's MariaDB for slurmdbd, and a controller node that can run it.

- MariaDB runs on the host (root over its unix socket, no password). Each test run gets its own
  database and user with a random password (``AccountingDb``), dropped afterwards.
- slurmdbd on the controller node reaches MariaDB through the socket: the host's ``/run/mysqld`` is
  bind-mounted into the node's root inside the node's own mount namespace (namespaces do not hide a
  unix socket; the node's ``/run`` is a private tmpfs, hence the bind).
- The lab's cached root filesystem carries slurmd but not slurmctld/slurmdbd. Until it does, the
  controller node gets them from the host's apt cache with dpkg (no network in the lab), with a
  policy-rc.d that stops package scripts from starting daemons: Ansible starts them.
"""

from __future__ import annotations

import json
import secrets
import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bcm.devserver import Server
from bcm.domain.naming import fold_hostlist
from bcm.lab import fakegpu
from bcm.lab.errors import LabError
from bcm.lab.lab import Lab
from bcm.lab.node import LabNode, exec_argv

MYSQL_SOCKET = Path("/run/mysqld/mysqld.sock")
APT_ARCHIVES = Path("/var/cache/apt/archives")
# dependency order; everything else they need is in the lab root filesystem already
CONTROLLER_DEBS = (
    "mysql-common",
    "mariadb-common",
    "libmariadb3",
    "slurm-wlm-mysql-plugin",
    "slurmdbd",
    "slurmctld",
)


def _run(argv: list[str], timeout: float = 120, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=stdin, check=False)
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


def ensure_mariadb(timeout_s: float = 60) -> None:
    """Start the host's MariaDB if its socket does not answer; bounded wait."""
    if _socket_answers(MYSQL_SOCKET):
        return
    if shutil.which("mariadbd") is None and not Path("/usr/sbin/mariadbd").exists():
        raise LabError("MariaDB is not installed on this machine (apt-get install mariadb-server)")
    Path("/run/mysqld").mkdir(exist_ok=True)
    shutil.chown("/run/mysqld", "mysql", "mysql")
    _run(["start-stop-daemon", "--start", "--oknodo", "--background", "--chuid", "mysql",
          "--exec", "/usr/sbin/mariadbd"])  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not _socket_answers(MYSQL_SOCKET):
        if time.monotonic() > deadline:
            raise LabError(f"MariaDB did not open {MYSQL_SOCKET} within {timeout_s:.0f}s")
        time.sleep(0.3)


def _sql(statement: str) -> None:
    _run(["mysql", "--protocol=socket", f"--socket={MYSQL_SOCKET}", "-uroot", "--batch"], stdin=statement)


@dataclass
class AccountingDb:
    """A database and a user of its own for one slurmdbd; ``drop()`` removes both."""

    name: str
    user: str
    password: str

    @classmethod
    def create(cls, prefix: str = "bcm_t") -> AccountingDb:
        ensure_mariadb()
        tag = secrets.token_hex(4)
        db = cls(f"{prefix}_{tag}", f"{prefix}_{tag}", secrets.token_urlsafe(18))
        _sql(
            f"CREATE DATABASE `{db.name}`;\n"
            f"CREATE USER '{db.user}'@'localhost' IDENTIFIED BY '{db.password}';\n"
            f"GRANT ALL ON `{db.name}`.* TO '{db.user}'@'localhost';\n"
        )
        return db

    def drop(self) -> None:
        _sql(f"DROP DATABASE IF EXISTS `{self.name}`;\nDROP USER IF EXISTS '{self.user}'@'localhost';\n")


def share_mysql_socket(node: LabNode) -> None:
    """Bind the host's /run/mysqld into the node's root (inside its mount namespace)."""
    if not node.alive or node.sshd_pid is None:
        raise LabError(f"lab node {node.name} is not running")
    target = f"{node.rootfs}/run/mysqld"
    script = f"mkdir -p {shlex.quote(target)} && mountpoint -q {shlex.quote(target)} || mount --bind /run/mysqld {shlex.quote(target)}"
    _run(["nsenter", f"--target={node.sshd_pid}", "--mount", "sh", "-c", script])


def install_controller_packages(node: LabNode) -> bool:
    """dpkg-install slurmctld and slurmdbd into the node from the host's apt cache; False if present."""
    root = node.root_view
    if root is None:
        raise LabError(f"lab node {node.name} is not running")
    if (root / "usr/sbin/slurmctld").exists() and (root / "usr/sbin/slurmdbd").exists():
        return False
    debs = []
    for pkg in CONTROLLER_DEBS:
        found = sorted(APT_ARCHIVES.glob(f"{pkg}_*.deb"))
        if not found:
            raise LabError(f"{pkg}: no .deb in {APT_ARCHIVES}; run `apt-get download {pkg}` there first")
        debs.append(found[-1])
    staging = root / "tmp/bcm-debs"
    staging.mkdir(parents=True, exist_ok=True)
    for deb in debs:
        shutil.copy2(deb, staging / deb.name)
    policy = root / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    try:
        files = [f"/tmp/bcm-debs/{d.name}" for d in debs]
        _run(exec_argv(node, ["env", "DEBIAN_FRONTEND=noninteractive", "dpkg", "-i", *files]), timeout=300)
    finally:
        policy.unlink(missing_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
    return True


def databases() -> list[str]:
    out = _run(
        [
            "mysql",
            "--protocol=socket",
            f"--socket={MYSQL_SOCKET}",
            "-uroot",
            "--batch",
            "-N",
            "-e",
            "SHOW DATABASES",
        ]
    )
    return out.stdout.split()


# ---- a whole scenario: lab nodes, fake GPUs, a real `bcm serve`, nodes registered and inventoried ----

# Lab-only Slurm settings (LAB.md): no cgroup process tracking in the nested namespaces, nodes may
# declare what their facts say even where the machine is shared, fake devices outside /dev.
LAB_SETTINGS: dict[str, object] = {
    "proctrack_type": "proctrack/linuxproc",
    "task_plugin": "task/none",
    "jobacct_gather_type": "jobacct_gather/linux",
    "slurmd_parameters": "config_overrides",
    "gpu_device_dir": fakegpu.DEVICE_DIR,
    "constrain_devices": False,
}


@dataclass
class SlurmLab:
    """A running lab with one controller and compute nodes, all registered and inventoried in bcm."""

    lab: Lab
    server: Server
    http: httpx.Client
    db: AccountingDb
    controller: str
    compute: list[str]
    gpus_per_node: int

    @property
    def hostlist(self) -> str:
        return fold_hostlist(self.compute)

    @classmethod
    @contextmanager
    def running(
        cls,
        lab_factory: Callable[..., Lab],
        work_dir: Path,
        *,
        nodes: int = 4,
        gpus_per_node: int = 2,
        name: str = "bcmslurm",
        subnet: str = "198.18.3.0/24",
        server_host: str = "127.0.0.1",
    ) -> Iterator[SlurmLab]:
        """Everything up (lab, MariaDB database, server, inventory); everything down afterwards.

        ``server_host="0.0.0.0"`` lets lab nodes reach the server at the head's lab address (agents).
        """
        server = Server(
            work_dir / "state",
            extra_env={"BCM_SSH__CONNECT_TIMEOUT_S": "5", "BCM_SSH__COMMAND_TIMEOUT_S": "120"},
            host=server_host,
        )
        db = AccountingDb.create()
        built: Lab | None = None
        try:
            server.start()
            http = httpx.Client(
                base_url=server.url, headers={"Authorization": f"Bearer {server.token()}"}, timeout=120
            )
            pubkey = http.get("/api/v1/ssh/public-key").json()["public_key"]
            built = lab_factory(nodes, [pubkey], name=name, subnet=subnet)
            members = built.status()
            controller, compute = members[0], members[1:]
            install_controller_packages(controller)
            share_mysql_socket(controller)
            for node in compute:
                fakegpu.install(node, gpus_per_node)
            for node in members:
                r = http.post(
                    "/api/v1/nodes",
                    json={
                        "name": node.name,
                        "mac": node.mac,
                        "ip": node.ip,
                        "ssh_host_key": node.host_key_public,
                    },
                )
                if r.status_code != 201:
                    raise LabError(f"registering {node.name}: {r.text}")
            run = cls(built, server, http, db, controller.name, [n.name for n in compute], gpus_per_node)
            inv = run.cli_raw("node", "inventory", fold_hostlist([n.name for n in members]), "--json")
            if inv.returncode != 0:
                raise LabError(f"inventory failed: {inv.stdout[-2000:]} {inv.stderr[-2000:]}")
            yield run
        finally:
            try:
                if built is not None:
                    built.down()
            finally:
                server.stop()
                db.drop()

    def deploy_body(self, *, nodes: str | None = None, verify: bool = True) -> dict[str, object]:
        return {
            "name": "lab",
            "controller": self.controller,
            "nodes": nodes or self.hostlist,
            "settings": {**LAB_SETTINGS, "storage_user": self.db.user, "storage_loc": self.db.name},
            "storage_pass": self.db.password,
            "verify": verify,
        }

    def wait(self, op_id: int, timeout_s: float = 900) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:  # bounded by timeout_s
            op: dict[str, Any] = self.http.get(f"/api/v1/operations/{op_id}").json()
            if op["state"] not in ("pending", "running"):
                return op
            if time.monotonic() > deadline:
                raise LabError(f"operation {op_id} still {op['state']} after {timeout_s:.0f}s")
            time.sleep(0.5)

    def deploy(self, *, verify: bool = True) -> dict[str, Any]:
        r = self.http.post("/api/v1/wlm/slurm/deploy", json=self.deploy_body(verify=verify))
        if r.status_code != 202:
            raise LabError(f"deploy refused: {r.status_code} {r.text}")
        return self.wait(int(r.json()["operation_id"]))

    def cli_raw(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The real CLI against the server."""
        from bcm.devserver import BCM, REPO

        return subprocess.run(
            [*BCM, *args],
            env=self.server.env(),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )

    def cli(self, *args: str) -> Any:
        done = self.cli_raw(*args)
        if done.returncode != 0:
            raise LabError(f"bcm {' '.join(args)}: {done.stdout[-1000:]} {done.stderr[-1000:]}")
        return json.loads(done.stdout)
