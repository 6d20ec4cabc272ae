"""A whole Slurm scenario for the lab tests, made with the documented commands only.

A real `bcm serve`, then `bcm lab up` (nodes with simulated GPUs, the host's MariaDB shared with them,
the lab's accounting database), `bcm node inventory`, and `bcm wlm deploy slurm`; `bcm lab down` at the
end. What the lab prepares for Slurm lives in :mod:`bcm.lab.accounting`.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bcm.devserver import BCM, REPO, Server
from bcm.domain.naming import fold_hostlist
from bcm.lab.accounting import LAB_SLURM_SETTINGS, AccountingDb
from bcm.lab.errors import LabError
from bcm.lab.lab import Lab

LAB_SETTINGS = LAB_SLURM_SETTINGS  # the name the tests use


@dataclass
class SlurmLab:
    """A running lab with one controller and compute nodes, all registered and inventoried in bcm."""

    lab: Lab
    server: Server
    http: httpx.Client
    controller: str
    compute: list[str]
    gpus_per_node: int

    @property
    def hostlist(self) -> str:
        return fold_hostlist(self.compute)

    @property
    def db(self) -> AccountingDb:
        """The lab's accounting database, as `bcm lab up` recorded it."""
        db = AccountingDb.of_lab(self.lab.state_dir)
        if db is None:
            raise LabError(f"lab {self.lab.name} has no accounting database")
        return db

    @classmethod
    @contextmanager
    def running(
        cls,
        work_dir: Path,
        *,
        nodes: int = 4,
        gpus_per_node: int = 2,
        name: str = "bcmslurm",
        subnet: str = "198.18.3.0/24",
        server_host: str = "127.0.0.1",
        bcm: list[str] | None = None,
        cwd: Path = REPO,
        database_url: str | None = None,
        env: dict[str, str] | None = None,
    ) -> Iterator[SlurmLab]:
        """Everything up (server, `bcm lab up`, inventory); everything down afterwards.

        ``server_host="0.0.0.0"`` lets lab nodes reach the server at the head's lab address (agents);
        ``bcm`` (with ``cwd``) runs another bcm than this checkout's, such as an installed wheel's bin/bcm;
        ``database_url`` puts the server on PostgreSQL (other servers may join it), ``env`` adds settings.
        """
        server = Server(
            work_dir / "state",
            database_url=database_url,
            extra_env={"BCM_SSH__CONNECT_TIMEOUT_S": "5", "BCM_SSH__COMMAND_TIMEOUT_S": "120", **(env or {})},
            host=server_host,
            argv=list(bcm or BCM),
            cwd=cwd,
        )
        built = Lab(server.state_dir / "lab" / name, name, subnet=subnet)  # where `bcm lab up` keeps it
        try:
            server.start()
            http = httpx.Client(
                base_url=server.url, headers={"Authorization": f"Bearer {server.token()}"}, timeout=120
            )
            run = cls(built, server, http, "", [], gpus_per_node)
            run.cli(
                "lab",
                "up",
                "--nodes",
                str(nodes),
                "--gpus",
                str(gpus_per_node),
                "--name",
                name,
                "--subnet",
                subnet,
                "--json",
            )
            members = [n.name for n in built.status()]
            run.controller, run.compute = members[0], members[1:]
            run.cli("node", "inventory", fold_hostlist(members), "--json")
            yield run
        finally:
            try:
                subprocess.run(
                    [*server.argv, "lab", "down", "--name", name],
                    env=server.env(),
                    cwd=server.cwd,
                    capture_output=True,
                    timeout=300,
                    check=False,
                )
                built.down()  # whatever the command left (it should leave nothing)
            finally:
                server.stop()

    def deploy_body(self, *, nodes: str | None = None, verify: bool = True) -> dict[str, object]:
        """What `bcm wlm deploy slurm --name lab` sends for this lab (its settings and password)."""
        db = self.db
        return {
            "name": "lab",
            "controller": self.controller,
            "nodes": nodes or self.hostlist,
            "settings": {**LAB_SETTINGS, "storage_user": db.user, "storage_loc": db.name},
            "storage_pass": db.password,
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
        """`bcm wlm deploy slurm` as a user runs it; the finished operation."""
        args = ["wlm", "deploy", "slurm", "--name", "lab", "--controller", self.controller]
        args += ["--nodes", self.hostlist, "--json", *([] if verify else ["--no-verify"])]
        done = self.cli_raw(*args)
        try:
            op: dict[str, Any] = json.loads(done.stdout)
        except ValueError:
            raise LabError(f"deploy: {done.returncode} {done.stdout[-1000:]} {done.stderr[-1000:]}") from None
        if (done.returncode == 0) != (op.get("state") == "succeeded"):
            raise LabError(f"deploy exit {done.returncode} disagrees with its operation: {op.get('state')}")
        return op

    def cli_raw(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The real CLI against the server."""
        return subprocess.run(
            [*self.server.argv, *args],
            env=self.server.env(),
            cwd=self.server.cwd,
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
