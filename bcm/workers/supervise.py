"""Supervised periodic loops and a bounded, complete shutdown.

:func:`supervise` runs one pass of a loop again and again: every ``interval_s`` (or sooner when its
``wake`` event is set) while passes succeed; after a failure, again after a delay that doubles with each
failure in a row (from ``interval_s``, at most ``max_backoff_s``). A streak of failures is logged once, as
an error, and its end once, as a recovery: a database away for an hour is two lines, not 3,600.
Cancelling the task ends it (a pass under way in a thread finishes there). Every periodic loop of the
server (workload-manager sync, health drains and staleness, the provisioning queue, the power poll, audit
pruning) runs this way, so none of them ends at its first error and none keeps an exception for shutdown.

:func:`stop_all` runs every shutdown step whatever the others did: each with its own timeout, a failure
or a timeout logged and the next step run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

log = logging.getLogger("bcm.workers")

MAX_BACKOFF_S = 300.0
STOP_TIMEOUT_S = 10.0


async def supervise(
    name: str,
    one_pass: Callable[[], Awaitable[object]],
    interval_s: float,
    *,
    wake: asyncio.Event | None = None,
    first_delay_s: float = 0.0,
    max_backoff_s: float = MAX_BACKOFF_S,
    logger: logging.Logger | None = None,
    sleep: Callable[[float], Awaitable[None]] | None = None,
) -> None:
    """Run ``one_pass()`` every ``interval_s`` until cancelled; a failure is logged once per streak and
    retried after a doubling delay (``sleep`` replaces the wait, for tests)."""
    logger = logger or log
    delay = first_delay_s
    failures = 0
    while True:
        if delay > 0:
            await _wait(delay, wake, sleep)
        try:
            await one_pass()
        except asyncio.CancelledError:
            raise
        except (
            Exception
        ) as exc:  # never the exception text at error level: it may carry a statement's parameters
            failures += 1
            delay = min(max(delay, interval_s) * 2, max(max_backoff_s, interval_s))
            if failures == 1:
                logger.error(
                    "%s failed (%s); retrying in %g s, again while it fails", name, type(exc).__name__, delay
                )
                logger.debug("%s failure", name, exc_info=True)
            else:
                logger.debug(
                    "%s failed again (%s, %d in a row); retrying in %g s",
                    name,
                    type(exc).__name__,
                    failures,
                    delay,
                )
            continue
        if failures:
            logger.warning("%s works again after %d failed passes", name, failures)
            failures = 0
        delay = interval_s


async def _wait(
    delay: float, wake: asyncio.Event | None, sleep: Callable[[float], Awaitable[None]] | None
) -> None:
    if sleep is not None:
        await sleep(delay)
        return
    if wake is None:
        await asyncio.sleep(delay)
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(wake.wait(), delay)
    wake.clear()


async def cancel(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` and wait for it; its own exception (if any) is logged, never raised."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception:
        log.exception("%s had failed", task.get_name())


async def stop_all(
    steps: Sequence[tuple[str, Callable[[], Awaitable[object]]]], timeout_s: float = STOP_TIMEOUT_S
) -> list[str]:
    """Run every step in order, each bounded by ``timeout_s``; returns the steps that failed or timed out."""
    failed = []
    for name, step in steps:
        try:
            async with asyncio.timeout(timeout_s):
                await step()
        except TimeoutError:
            log.error("shutdown: %s did not finish within %g s; going on", name, timeout_s)
            failed.append(name)
        except Exception as exc:
            log.error("shutdown: %s failed (%s); going on", name, type(exc).__name__, exc_info=True)
            failed.append(name)
    return failed
