"""Supervised loops and the bounded shutdown (bcm.workers.supervise), with real asyncio tasks."""

from __future__ import annotations

import asyncio
import logging

import pytest

from bcm.workers.supervise import cancel, stop_all, supervise


def test_a_failing_pass_is_logged_once_backed_off_retried_and_cancel_ends_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    passes: list[str] = []
    delays: list[float] = []

    async def one_pass() -> None:
        passes.append("pass")
        if 2 <= len(passes) <= 4:
            raise OSError("database away")

    async def sleep(seconds: float) -> None:
        delays.append(seconds)
        if len(delays) == 6:
            raise asyncio.CancelledError  # what cancelling the task does

    logger = logging.getLogger("bcm.test.supervise")
    with caplog.at_level(logging.DEBUG, logger=logger.name), pytest.raises(asyncio.CancelledError):
        asyncio.run(supervise("the loop", one_pass, 5, max_backoff_s=30, logger=logger, sleep=sleep))
    assert delays == [5, 10, 20, 30, 5, 5]  # doubled while failing (capped), the interval once it works
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "the loop failed (OSError)" in errors[0]
    assert any("works again after 3 failed passes" in r.getMessage() for r in caplog.records)
    assert "database away" not in "".join(errors)  # the type only: a message may carry parameters


def test_shutdown_runs_every_step_whatever_the_others_raised_or_how_long_they_took() -> None:
    ran: list[str] = []

    async def fails() -> None:
        ran.append("fails")
        raise RuntimeError("a loop's stored error")

    async def hangs() -> None:
        ran.append("hangs")
        await asyncio.Event().wait()

    async def stops(name: str) -> None:
        ran.append(name)

    async def crashed_task() -> None:
        raise ValueError("ended by an error")

    async def go() -> list[str]:
        task = asyncio.create_task(crashed_task())
        await asyncio.sleep(0)
        return await stop_all(
            [
                ("loop", lambda: cancel(task)),  # its exception is logged, not raised
                ("failing step", fails),
                ("hanging step", hangs),
                ("dnsmasq", lambda: stops("dnsmasq")),
                ("operations", lambda: stops("operations")),
            ],
            timeout_s=0.2,
        )

    failed = asyncio.run(go())
    assert ran == ["fails", "hangs", "dnsmasq", "operations"]
    assert failed == ["failing step", "hanging step"]
