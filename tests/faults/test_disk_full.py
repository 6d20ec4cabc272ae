"""A full disk under the SQLite state directory: writes get 507, reads are served, writes resume."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bcm.devserver import Server
from tests.faults.conftest import client

SIZE_MB = 24


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of a few MiB mounted as the state directory (needs root)."""
    mount = tmp_path / "state"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE_MB}m,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(path: Path) -> None:
    """Write zeros until the disk refuses more (bounded by the disk's size)."""
    chunk = b"\0" * 65536
    with open(path, "wb") as f, contextlib.suppress(OSError):
        for _ in range(SIZE_MB * 16 + 16):
            f.write(chunk)
            f.flush()


def test_full_disk_refuses_writes_with_507_and_keeps_serving_reads(small_disk: Path) -> None:
    srv = Server(small_disk)
    srv.start()
    try:
        with client(srv) as c:
            assert c.post("/api/v1/nodes/bulk", json={"nodes": "pre[001-200]"}).status_code == 201
            filler = small_disk / "filler"
            _fill(filler)
            # small writes may fit in pages SQLite already owns; bigger ones must grow a file
            answers = []
            for i in range(20):
                r = c.post("/api/v1/nodes/bulk", json={"nodes": f"full{i}-[0001-2000]"})
                answers.append(r.status_code)
                if r.status_code == 507:
                    body = r.json()
                    assert body["error"] == "StorageFull" and "disk is full" in body["message"]
                    break
                assert r.status_code == 201, r.text
            assert answers[-1] == 507, answers
            # reads are served while the disk is full
            r = c.get("/api/v1/nodes", params={"nodes": "pre[001-200]", "limit": 1000})
            assert r.status_code == 200 and r.json()["total"] == 200
            assert c.get("/api/v1/nodes/pre001").status_code == 200
            assert c.get("/readyz").status_code == 200
            # space returns: writes resume without a restart
            filler.unlink()
            r = c.post("/api/v1/nodes", json={"name": "after-space"})
            assert r.status_code == 201, r.text
            r = c.post("/api/v1/nodes/bulk", json={"nodes": "again[0001-2000]"})
            assert r.status_code == 201, r.text[:300]
            assert c.get("/api/v1/nodes/after-space").status_code == 200
    finally:
        srv.stop()
