"""One bounded fan-out for every driver that works on many hosts (SSH commands, rsync pushes).

At most ``limit`` items run at once; results come back in input order; ``on_result`` sees each result as
it finishes, one at a time from the calling coroutine (so it may use a single DB session), and if it
raises, the items still running are cancelled and the exception propagates.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

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
