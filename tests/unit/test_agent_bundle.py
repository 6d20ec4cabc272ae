"""The agent zipapp runs with nothing but the standard library (isolated mode, no site-packages)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

from bcm.agent.bundle import AGENT_MODULES, build_bundle
from bcm.lab.fakegpu import RECORDED_NVML

DATA = RECORDED_NVML


def write_bundle(tmp_path: Path) -> Path:
    path = tmp_path / "bcm-agent.pyz"
    path.write_bytes(build_bundle())
    return path


def run_isolated(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # -I: no user site, no PYTHON* variables, no script directory on sys.path; -S: no site-packages,
    # so only the standard library and the archive itself are importable.
    return subprocess.run(
        [sys.executable, "-I", "-S", str(write_bundle(tmp_path)), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_bundle_holds_the_agent_and_pynvml_only(tmp_path: Path) -> None:
    data = build_bundle()
    assert data.startswith(b"#!/usr/bin/env python3\n")
    with zipfile.ZipFile(write_bundle(tmp_path)) as archive:
        names = set(archive.namelist())
    assert names == {
        "__main__.py",
        "bcm/__init__.py",
        "pynvml.py",
        *(f"bcm/agent/{m}.py" for m in AGENT_MODULES),
    }
    assert build_bundle() == data  # reproducible


def test_bundle_help_runs_isolated(tmp_path: Path) -> None:
    result = run_isolated(tmp_path, "--help")
    assert result.returncode == 0, result.stderr
    assert "bcm-agent" in result.stdout and "--once" in result.stdout


def test_bundle_collects_from_a_fixture_isolated(tmp_path: Path) -> None:
    result = run_isolated(
        tmp_path, "--once", "--fake", str(DATA / "h100_sxm_565.json"), "--expected-gpus", "3"
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [g["uuid"][:12] for g in report["gpus"]] == ["GPU-b42dd28e", "GPU-7c3cadbd", "GPU-2d50cdf6"]


def test_bundle_uses_its_own_pynvml_and_says_when_nvml_is_missing(tmp_path: Path) -> None:
    result = run_isolated(tmp_path, "--once")
    # No GPU driver here: the bundled pynvml loads and reports the missing library (exit 3). On a GPU
    # machine the same command prints a report.
    if result.returncode == 0:
        assert json.loads(result.stdout)["gpu_count"] >= 0
    else:
        assert result.returncode == 3, result.stderr
        assert "NVML" in result.stderr and "pynvml is not importable" not in result.stderr
