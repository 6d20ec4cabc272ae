"""The sendfile pool holds one thread per allowed transfer: no download waits for a thread while it
holds its slot (a pool smaller than ``images.max_transfers`` would stall the downloads beyond it)."""

from __future__ import annotations

import threading

from bcm import pathsend


def test_pool_runs_as_many_copies_at_once_as_transfers_allowed() -> None:
    transfers = 80  # above the pool's default size
    pathsend.size_pool(transfers)
    try:
        together = threading.Barrier(transfers, timeout=10)  # breaks unless all run at the same time
        futures = [pathsend._pool.submit(together.wait) for _ in range(transfers)]
        assert sorted(f.result(timeout=20) for f in futures) == list(range(transfers))
    finally:
        pathsend.size_pool(16)
