"""`bcm lab up --heads N` refuses what cannot work with one readable line and exit 1, before it touches
anything (no root, no lab needed): no database URL, SQLite, a TCP address the heads' namespaces cannot reach,
a head count out of bounds; and `--database-url` without `--heads`. Every address here is parsed, never
contacted, and is loopback all the same."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bcm.lab import LabError
from bcm.lab.heads import check_database_url

ROOT = Path(__file__).resolve().parents[2]
SOCKET_URL = "postgresql+psycopg://bcm@/bcm?host=/var/run/postgresql"


def bcm_lab_up(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BCM_")} | {"BCM_STATE_DIR": str(tmp_path)}
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "lab", "up", "--state-dir", str(tmp_path / "lab"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--heads", "2"], "--database-url"),
        (["--heads", "2", "--database-url", "sqlite:////tmp/bcm.db"], "SQLite"),
        (["--heads", "2", "--database-url", "postgresql+psycopg://bcm@127.0.0.1/bcm"], "socket"),
        (["--heads", "6", "--database-url", SOCKET_URL], "2 to 5 heads"),
        (["--heads", "1", "--database-url", SOCKET_URL], "2 to 5 heads"),
        (["--heads", "2", "--database-url", SOCKET_URL, "--subnet", "127.1.0.0/24"], "198.18.0.0/15"),
        (["--database-url", SOCKET_URL], "--heads"),
    ],
)
def test_heads_refused_with_one_line(tmp_path: Path, args: list[str], says: str) -> None:
    proc = bcm_lab_up(tmp_path, *args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and proc.stdout == ""
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], proc.stderr
    assert not (tmp_path / "lab").exists()  # refused before anything was made


def test_database_urls_the_heads_can_share() -> None:
    for url in (
        SOCKET_URL,
        "postgresql+psycopg://bcm@/bcm",
        "postgresql://bcm:pw@198.18.229.254:5432/bcm",
        "postgresql+psycopg://bcm@/bcm?host=/run/pg&host=/run/pg2",
    ):
        assert check_database_url(url) == url
    for url in (
        None,
        "",
        "sqlite:///x.db",
        "mysql://a@b/c",
        "postgresql://bcm@localhost/bcm",
        "postgresql+psycopg://bcm@/bcm?host=/run/pg&host=127.0.0.5:5432",
        "not a url",
    ):
        with pytest.raises(LabError):
            check_database_url(url)
