"""Image deltas for `auto` installs (#30), built off the request path: one at a time, once per key.

``bcm.drivers.imagedelta.build`` unpacks two root images and compares them: seconds to minutes of disk and CPU.
It runs on this worker's own thread (never the request pool), one build at a time, each bounded by a timeout;
nodes asking for the same delta at once wait on the one build (and later ones find the archive made). At
shutdown the build in progress is stopped (its unsquashfs or tar killed) and the thread is not waited for.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bcm.drivers import imagedelta

log = logging.getLogger("bcm.deltas")
BUILD_TIMEOUT_S = 900.0
RETRY_AFTER_S = 600.0


@dataclass(frozen=True)
class DeltaJob:
    """The archive ``out`` from ``old`` to ``new`` (root squashfs files), ``skip`` left out."""

    old: Path
    new: Path
    out: Path
    skip: tuple[str, ...]
    what: str  # "disk:1 → disk:2", for the log


class Deltas:
    def __init__(self, timeout_s: float = BUILD_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bcm-delta")
        self._building: dict[Path, asyncio.Future[imagedelta.Delta]] = {}
        self._failed: dict[Path, tuple[float, str]] = {}  # archive → (when, why) of its last failed build

    async def get(self, job: DeltaJob) -> imagedelta.Delta:
        """The archive, built now if it is not there yet. Raises :class:`imagedelta.DeltaError`; a build that
        failed is not tried again for ``RETRY_AFTER_S`` (every node of a rack asking gets the same answer at once)."""
        if job.out.is_file():
            return imagedelta.Delta(job.out, -1, -1, job.out.stat().st_size)
        if self._stop.is_set():
            raise imagedelta.DeltaError("the server is shutting down")
        failed = self._failed.get(job.out)
        if failed is not None and time.monotonic() - failed[0] < RETRY_AFTER_S:
            raise imagedelta.DeltaError(failed[1])
        pending = self._building.get(job.out)
        if pending is None:
            loop = asyncio.get_running_loop()
            pending = asyncio.ensure_future(loop.run_in_executor(self._pool, self._build, job))
            self._building[job.out] = pending
            pending.add_done_callback(lambda done: self._settled(job.out, done))
        return await asyncio.shield(pending)

    def _settled(self, out: Path, done: asyncio.Future[imagedelta.Delta]) -> None:
        self._building.pop(out, None)
        exc = None if done.cancelled() else done.exception()
        if isinstance(exc, imagedelta.DeltaError):
            if len(self._failed) >= 1000:  # bounded: the oldest goes
                self._failed.pop(next(iter(self._failed)))
            self._failed[out] = (time.monotonic(), str(exc))

    def _build(self, job: DeltaJob) -> imagedelta.Delta:
        if job.out.is_file():  # made while this one waited its turn
            return imagedelta.Delta(job.out, -1, -1, job.out.stat().st_size)
        job.out.parent.mkdir(parents=True, exist_ok=True)
        delta = imagedelta.build(
            job.old, job.new, job.out, skip=job.skip, timeout_s=self.timeout_s, stop=self._stop
        )
        log.info(
            "image delta %s: %d entries changed, %d removed, %d bytes",
            job.what,
            delta.changed,
            delta.removed,
            delta.size,
        )
        return delta

    async def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
