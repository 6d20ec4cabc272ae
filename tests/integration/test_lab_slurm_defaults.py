"""`bcm wlm deploy slurm` on lab nodes takes what `bcm lab up` recorded; without MariaDB it says why."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from bcm.devserver import BCM, REPO, free_port
from bcm.lab import accounting


def deploy(state: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BCM_")}
    env |= {"BCM_STATE_DIR": str(state), "BCM_URL": f"http://127.0.0.1:{free_port()}", "BCM_TOKEN": "x"}
    return subprocess.run(
        [*BCM, "wlm", "deploy", "slurm", "--controller", "node01", "--nodes", "node[02-03]", *extra],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def record_lab(state: Path, settings: dict[str, object], password: str | None) -> None:
    lab_dir = state / "lab" / "bcmlab"
    accounting.write_slurm_defaults(lab_dir, ["node01", "node02", "node03"], settings)
    if password:
        (lab_dir / accounting.PASS_FILE).write_text(password + "\n")


def test_lab_without_mariadb_is_a_clear_error(tmp_path: Path) -> None:
    record_lab(tmp_path, dict(accounting.LAB_SLURM_SETTINGS), None)
    done = deploy(tmp_path)
    assert done.returncode == 1
    assert "no accounting database" in done.stderr and "apt-get install mariadb-server" in done.stderr


def test_lab_defaults_are_used_and_the_server_is_asked(tmp_path: Path) -> None:
    settings = {**accounting.LAB_SLURM_SETTINGS, "storage_user": "u1", "storage_loc": "db1"}
    record_lab(tmp_path, settings, "pw-from-lab")
    done = deploy(tmp_path)
    assert done.returncode == 1 and "cannot reach" in done.stderr, done.stderr  # past the lab step
    assert "lab bcmlab: lab Slurm settings and accounting database db1" in done.stderr
    assert "pw-from-lab" not in done.stdout + done.stderr


def test_nodes_outside_the_lab_get_no_lab_settings(tmp_path: Path) -> None:
    record_lab(tmp_path, dict(accounting.LAB_SLURM_SETTINGS), None)
    lab_file = tmp_path / "lab" / "bcmlab" / accounting.SETTINGS_FILE
    data = json.loads(lab_file.read_text())
    data["nodes"] = ["node01", "node02"]  # node03 is not in this lab
    lab_file.write_text(json.dumps(data))
    done = deploy(tmp_path)
    assert done.returncode == 1 and "cannot reach" in done.stderr and "lab bcmlab" not in done.stderr


def test_a_vm_that_became_a_node_counts_among_the_lab_nodes(tmp_path: Path) -> None:
    """`bcm lab vm-bmc VM NODE` records NODE with the lab (accounting.add_slurm_nodes): a deploy onto it
    then takes the lab's settings, where before it was "outside the lab"."""
    record_lab(tmp_path, {**accounting.LAB_SLURM_SETTINGS, "storage_user": "u1", "storage_loc": "db1"}, "pw")
    lab_dir = tmp_path / "lab" / "bcmlab"
    data = json.loads((lab_dir / accounting.SETTINGS_FILE).read_text())
    data["nodes"] = ["node01", "node02"]
    (lab_dir / accounting.SETTINGS_FILE).write_text(json.dumps(data))
    assert "lab bcmlab" not in deploy(tmp_path).stderr
    assert accounting.add_slurm_nodes(lab_dir, ["node03", "node02"]) is True
    assert accounting.slurm_defaults(lab_dir)[0] == ["node01", "node02", "node03"]  # once each, in order
    assert "lab bcmlab: lab Slurm settings" in deploy(tmp_path).stderr
    assert accounting.add_slurm_nodes(tmp_path / "no-such-lab", ["x"]) is False
