"""The wheel on lab nodes: bcm installed from its wheel outside the checkout (tests/wheel.py) serves, brings
up a lab, inventories it and deploys Slurm with the playbooks and templates it carries, as
tests/lab/test_slurm.py does with the checkout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bcm.lab import fakegpu
from bcm.lab.slurm import SlurmLab
from tests.lab.conftest import lab_unavailable
from tests.wheel import Installed, install

pytestmark = pytest.mark.lab

GPUS = 2


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    reason = lab_unavailable()  # module fixtures come first: skip before the minute spent on the wheel
    if reason:
        pytest.skip(reason)
    return install(tmp_path_factory.mktemp("wheel"))


def explain(op: dict[str, Any]) -> str:
    return f"{op['state']}: {op.get('error')}\n{op.get('results')}\n{op.get('log', '')[-4000:]}"


@pytest.mark.timeout(2400)  # the wheel and its virtualenv, then the lab, inventory and deploy
def test_lab_inventory_and_slurm_deploy_from_the_wheel(
    lab_required: None, installed: Installed, tmp_path: Path
) -> None:
    with SlurmLab.running(
        tmp_path,
        nodes=3,
        gpus_per_node=GPUS,
        name="bcmwheel",
        subnet="198.18.11.0/24",
        bcm=installed.bcm,
        cwd=installed.work,
    ) as run:
        assert run.server.proc is not None
        cmdline = Path(f"/proc/{run.server.proc.pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[0].decode().startswith(str(installed.venv)), cmdline  # the wheel's python serves

        # `bcm lab up` and `bcm node inventory` (both from the wheel) ran in SlurmLab.running
        for name in run.compute:
            hw = run.http.get(f"/api/v1/nodes/{name}/hardware").json()
            assert [g["uuid"] for g in hw["gpus"]] == [fakegpu.gpu_uuid(name, i) for i in range(GPUS)], hw

        op = run.deploy()  # `bcm wlm deploy slurm`: the wheel's ansible/slurm.yml and Slurm templates
        assert op["state"] == "succeeded", explain(op)
        assert set(op["results"]) == {run.controller, *run.compute}
        assert all(r["status"] == "ok" for r in op["results"].values()), op["results"]
        assert "verify: passed" in op["log"], op["log"]

        done = run.lab.run(run.controller, ["sinfo", "--noheader", "--Node", "--format=%N %T %G"], timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()}
        assert rows == {n: ["idle", f"gpu:h100:{GPUS}"] for n in run.compute}, done.stdout
        cluster = run.http.get("/api/v1/wlm/lab").json()
        assert cluster["state"] == "deployed" and cluster["last_verify_ok"] is True, cluster
