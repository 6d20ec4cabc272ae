"""Golden tests: each Slurm template rendered for fixed clusters, compared with exact expected text.

Regenerate after an intended change with ``BCM_UPDATE_GOLDEN=1 pytest tests/golden`` and review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bcm.domain.slurm import NodeInput, SlurmSettings, build_cluster
from bcm.drivers.wlm import slurm
from bcm.services.render import render

GOLDEN = Path(__file__).parent / "slurm"


def render_slurm_files(cluster, password):
    return slurm.render_files(cluster, password, render)


H100 = "NVIDIA H100 80GB HBM3"


def _facts(sockets: int | None, cores: int, threads: int, mem_gib: int) -> dict:
    return {"cpu": {"sockets": sockets, "cores": cores, "threads": threads}, "memory_bytes": mem_gib << 30}


def _production():
    nodes = [
        NodeInput(
            f"gpu{i:02d}",
            f"198.18.0.{10 + i}",
            _facts(2, 112, 224, 2048),
            [(g, H100) for g in range(8)],
            "dgx",
        )
        for i in (1, 2)
    ]
    nodes.append(
        NodeInput(
            "gpu03",
            None,
            _facts(None, 64, 128, 512),
            [(0, "NVIDIA A100-SXM4-80GB"), (1, "NVIDIA A100-SXM4-80GB"), (3, "NVIDIA L40S")],
            None,
        )
    )
    nodes.append(NodeInput("cpu01", "198.18.0.20", _facts(1, 16, 16, 64), [], "cpu"))
    settings = SlurmSettings(accounting_enforce="associations,limits,qos")
    return build_cluster("prod", "head01", "198.18.0.1", nodes, settings), "s3cret-pass"


def _lab_inputs() -> list[NodeInput]:
    return [
        NodeInput(f"node{i:02d}", f"198.18.0.{10 + i}", _facts(1, 2, 2, 24), [(0, H100), (1, H100)], None)
        for i in (2, 3, 4)
    ]


def _lab(*, tenancy: bool = False):
    nodes = _lab_inputs()
    settings = SlurmSettings(
        proctrack_type="proctrack/linuxproc",
        task_plugin="task/none",
        jobacct_gather_type="jobacct_gather/linux",
        slurmd_parameters="config_overrides",
        gpu_device_dir="/var/lib/bcm-fakegpu",
        constrain_devices=False,
        storage_user="bcm_lab",
        storage_loc="bcm_lab_acct",
    )
    settings = slurm.effective_settings(settings, tenancy=tenancy)
    return build_cluster("lab", "node01", None, nodes, settings), ""


def _lab_tenancy():
    """The lab once departments exist: accounting enforced, nothing else changed."""
    return _lab(tenancy=True)


def _nvml():
    nodes = [NodeInput("gpu01", None, _facts(2, 112, 224, 2048), [(g, H100) for g in range(8)], None)]
    return build_cluster("nv", "head01", None, nodes, SlurmSettings(gres_autodetect="nvml")), ""


CASES = {"production": _production, "lab": _lab, "lab_tenancy": _lab_tenancy, "nvml": _nvml}


@pytest.mark.parametrize("case", sorted(CASES))
def test_slurm_templates_match_golden(case: str) -> None:
    cluster, password = CASES[case]()
    files = render_slurm_files(cluster, password)
    assert sorted(files) == ["cgroup.conf", "gres.conf", "slurm.conf", "slurmdbd.conf"]
    for name, text in files.items():
        expected = GOLDEN / case / name
        if os.environ.get("BCM_UPDATE_GOLDEN"):
            expected.parent.mkdir(parents=True, exist_ok=True)
            expected.write_text(text)
        assert text == expected.read_text(), f"{case}/{name} differs from its golden file"


def test_password_appears_only_in_slurmdbd_conf() -> None:
    cluster, password = _production()
    files = render_slurm_files(cluster, password)
    assert f"StoragePass={password}\n" in files["slurmdbd.conf"]
    assert all(password not in text for name, text in files.items() if name != "slurmdbd.conf")


def test_no_password_line_without_a_password() -> None:
    cluster, _ = _lab()
    assert "StoragePass" not in render_slurm_files(cluster, "")["slurmdbd.conf"]


def test_accounting_enforced_only_once_departments_exist() -> None:
    plain = render_slurm_files(_lab()[0], "")["slurm.conf"]
    tenancy = render_slurm_files(_lab_tenancy()[0], "")["slurm.conf"]
    assert "AccountingStorageEnforce" not in plain
    assert "AccountingStorageEnforce=associations,limits,qos\n" in tenancy
    # a value stored with the cluster wins over bcm's default
    kept = slurm.effective_settings(SlurmSettings(accounting_enforce="associations"), tenancy=True)
    assert kept.accounting_enforce == "associations"


def test_priority_calc_period_only_when_not_slurms_default() -> None:
    cluster, _ = _lab()
    assert "PriorityCalcPeriod" not in render_slurm_files(cluster, "")["slurm.conf"]
    fast = build_cluster("lab", "node01", None, list(_lab_inputs()), SlurmSettings(priority_calc_period=1))
    assert "\nPriorityCalcPeriod=1\n" in render_slurm_files(fast, "")["slurm.conf"]
