"""Test helper: bcm as a head node gets it. A wheel built from a copy of this tree, installed with its
dependencies into a fresh virtualenv outside the checkout, run from a directory that is not the checkout
and with an environment that names nothing of it (no BCM_*, VIRTUAL_ENV, PYTHONPATH, no checkout on PATH).

The virtualenv needs PyPI (or pip's cache) for the dependencies: about 40 s with a warm cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA_DIRS = ("templates", "ansible", "images")  # bcm's run-time files: bcm._data.<dir> in the wheel
SKIPPED = shutil.ignore_patterns(
    ".git",
    ".venv",
    "__pycache__",
    "*.pyc",
    "*.egg-info",
    "build",
    "dist",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".state",
    "artifacts",
)
BUILD_TIMEOUT_S = 600


@dataclass(frozen=True)
class Installed:
    venv: Path
    wheel: Path
    work: Path  # the current directory for every command: outside the checkout

    def bin(self, name: str) -> Path:
        return self.venv / "bin" / name

    @property
    def bcm(self) -> list[str]:
        return [str(self.bin("bcm"))]

    def env(self, **extra: str) -> dict[str, str]:
        return clean_env() | extra

    def python(self, code: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """``python -c code`` in the installed virtualenv."""
        return subprocess.run(
            [str(self.bin("python")), "-c", code],
            cwd=self.work,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )


def clean_env() -> dict[str, str]:
    """This environment without anything that points at the checkout or its virtualenv."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("BCM_") and k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")
    }
    env["PATH"] = ":".join(
        p for p in env.get("PATH", "/usr/bin:/bin").split(":") if p and not p.startswith(str(REPO))
    )
    return env


def _run(argv: list[str], cwd: Path) -> None:
    done = subprocess.run(
        argv, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}"
        )


def install(dest: Path) -> Installed:
    """Build the wheel from a copy of the tree (a build never writes into the checkout) and install it."""
    source, dist, venv, work = dest / "source", dest / "dist", dest / "venv", dest / "work"
    shutil.copytree(REPO, source, ignore=SKIPPED)
    work.mkdir()
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(source)], dest)
    wheels = sorted(dist.glob("bcm-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one bcm wheel in {dist}, found {[w.name for w in wheels]}")
    shutil.rmtree(source)  # nothing of the tree is left to import from by accident
    _run([sys.executable, "-m", "venv", str(venv)], dest)
    _run([str(venv / "bin" / "pip"), "install", "-q", str(wheels[0])], work)
    return Installed(venv, wheels[0], work)


def data_files() -> list[str]:
    """Every run-time file in the checkout, as ``<dir>/<path>`` (compiled files aside)."""
    return sorted(
        p.relative_to(REPO).as_posix()
        for top in DATA_DIRS
        for p in (REPO / top).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
