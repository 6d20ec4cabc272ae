"""Blocking calls to external systems run on threads of their own kind, never on the request worker threads.

The server answers HTTP with a bounded pool of worker threads (``db.threads``) that plain handlers,
dependencies and short database transactions share. A BMC that never answers, an Ansible run of half an
hour, a Kubernetes API call or an unsquashfs held one of those threads each, so two power operations against
hung BMCs could leave no thread for requests (#27). Each kind here has its own cap, sized for its work;
a call beyond the cap waits for one of its own kind, never for a request's thread. Every caller bounds
its call in time itself (the drivers' timeouts).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import TypeVar

import anyio

T = TypeVar("T")

# concurrent blocking calls per kind (the drivers bound each call in time)
LIMITS = {
    "bmc": 128,  # Redfish (sushy); two power operations at the default concurrency (32) fit with room
    "ansible": 8,  # ansible-playbook runs of deploys (each a process tree of its own)
    "kubernetes": 16,  # the Kubernetes API client
    "image": 4,  # image builds and squashfs unpacks for pushes (disk-bound)
}
_limiters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, anyio.CapacityLimiter]] = (
    weakref.WeakKeyDictionary()
)


def limiter(kind: str) -> anyio.CapacityLimiter:
    """The cap of ``kind`` in the running event loop."""
    per_loop = _limiters.setdefault(asyncio.get_running_loop(), {})
    if kind not in per_loop:
        per_loop[kind] = anyio.CapacityLimiter(LIMITS[kind])
    return per_loop[kind]


async def run(kind: str, fn: Callable[..., T], *args: object, abandon_on_cancel: bool = False) -> T:
    """``fn(*args)`` in a thread of ``kind``'s own cap."""
    return await anyio.to_thread.run_sync(
        fn, *args, limiter=limiter(kind), abandon_on_cancel=abandon_on_cancel
    )
