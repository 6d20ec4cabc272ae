"""One bounded fan-out for every driver that works on many hosts (SSH commands, rsync pushes).

At most ``limit`` items run at once; results come back in input order; ``on_result`` sees each result as
it finishes, one at a time from the calling coroutine (so it may use a single DB session), and if it
raises, the items still running are cancelled and the exception propagates.

:class:`Gate` is the adaptive form of the limit, for drivers that retry: a slot is held for one
attempt and given back during the backoff, and how many slots exist follows an
:class:`~bcm.domain.fanout.AimdLimit` (the SSH fan-out's).
"""

from __future__ import annotations

import asyncio
import collections
import inspect
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

from bcm.domain.fanout import AimdLimit

T = TypeVar("T")
R = TypeVar("R")


async def fan_out(
    items: Sequence[T],
    run: Callable[[T], Awaitable[R]],
    limit: int,
    on_result: Callable[[R], Any] | None = None,
) -> list[R]:
    """``run`` on every item, at most ``limit`` at once; the results in input order."""
    gate = asyncio.Semaphore(max(1, limit))

    async def one(index: int, item: T) -> tuple[int, R]:
        async with gate:
            return index, await run(item)

    tasks = [asyncio.ensure_future(one(i, item)) for i, item in enumerate(items)]
    results: list[tuple[bool, R | None]] = [(False, None)] * len(tasks)
    try:
        for next_done in asyncio.as_completed(tasks):
            index, result = await next_done
            results[index] = (True, result)
            if on_result is not None:
                outcome = on_result(result)
                if inspect.isawaitable(outcome):
                    await outcome
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return [r for done, r in results if done]  # type: ignore[misc]


class Gate:
    """At most ``control.limit`` holders at once; waiters get slots first come, first served.

    A release wakes only as many waiters as there are free slots (a thousand waiters cost a thousand
    wake-ups in all, not per release). When the limit shrinks, holders above it finish; no new one enters
    until the count is under the limit again.
    """

    def __init__(self, control: AimdLimit) -> None:
        self.control = control
        self.in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def __aenter__(self) -> None:
        if not self._waiters and self.in_flight < self.control.limit:
            self.in_flight += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # a slot was handed over just as we were cancelled: pass it on
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._release()

    def _release(self) -> None:
        self.in_flight -= 1
        self.wake()

    def wake(self) -> None:
        """Hand free slots to the longest waiters (also after the limit has grown)."""
        while self._waiters and self.in_flight < self.control.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)
