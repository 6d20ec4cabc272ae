"""The fan-out's pure rules (bcm.domain.fanout) and its gate: the clock and the random generator are
driven by the test, so nothing here depends on how fast the machine is."""

from __future__ import annotations

import asyncio
import random

import pytest

from bcm.domain.fanout import AimdLimit, RetryPolicy, fan_out_budget, is_transient
from bcm.drivers.fanout import Gate


@pytest.mark.parametrize(
    ("status", "command_started", "transient"),
    [
        ("timed_out", False, True),  # no SSH login within the connect timeout
        ("unreachable", False, True),  # reset, refused, no route before the login
        ("timed_out", True, False),  # the command ran past its bound: never run it twice
        ("unreachable", True, False),  # dropped while the command ran
        ("auth_failed", False, False),
        ("host_key_changed", False, False),
        ("command_failed", True, False),
        ("ok", True, False),
    ],
)
def test_only_connect_stage_failures_are_transient(
    status: str, command_started: bool, transient: bool
) -> None:
    assert is_transient(status, command_started) is transient


def test_backoff_doubles_to_its_cap_with_jitter_in_the_upper_half() -> None:
    policy = RetryPolicy(attempts=10, backoff_s=0.5, backoff_cap_s=4.0)
    low, high = random.Random(), random.Random()
    low.random = lambda: 0.0  # type: ignore[method-assign]
    high.random = lambda: 0.999999  # type: ignore[method-assign]
    full = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    for attempt, d in enumerate(full, start=1):
        assert policy.delay(attempt, low) == pytest.approx(d / 2)
        assert policy.delay(attempt, high) == pytest.approx(d, rel=1e-5)


def test_jitter_spreads_hosts_that_failed_together() -> None:
    policy = RetryPolicy()
    rng = random.Random(7)
    waits = {round(policy.delay(1, rng), 6) for _ in range(50)}
    assert len(waits) > 40  # fifty hosts timed out together; they do not come back together
    assert all(0.25 <= w <= 0.5 for w in waits)


def test_retries_are_bounded_in_count() -> None:
    policy = RetryPolicy(attempts=3, backoff_s=0.1)
    rng = random.Random(1)
    decided = [
        policy.next_delay(a, True, now=0.0, deadline=1e9, connect_s=1.0, rng=rng) for a in (1, 2, 3, 4)
    ]
    assert decided[0] is not None and decided[1] is not None
    assert decided[2] is None and decided[3] is None  # the third try was the last


def test_definite_failures_are_never_retried() -> None:
    policy = RetryPolicy(attempts=5)
    assert policy.next_delay(1, False, now=0.0, deadline=1e9, connect_s=1.0, rng=random.Random(1)) is None


def test_no_retry_that_could_not_connect_before_the_deadline() -> None:
    policy = RetryPolicy(attempts=5, backoff_s=1.0)
    rng = random.Random()
    rng.random = lambda: 0.0  # type: ignore[method-assign]  # a wait of exactly 0.5 s
    assert policy.next_delay(1, True, now=10.0, deadline=20.5, connect_s=10.0, rng=rng) == pytest.approx(0.5)
    assert policy.next_delay(1, True, now=10.1, deadline=20.5, connect_s=10.0, rng=rng) is None


def test_budget_matches_the_work_engines_batches() -> None:
    assert fan_out_budget(1000, 256, 10.0, 60.0) == 4 * 70.0
    assert fan_out_budget(0, 256, 10.0, 60.0) == 70.0
    assert fan_out_budget(1, 1, 2.0, 3.0) == 5.0


def test_aimd_starts_at_the_ceiling_and_never_passes_it() -> None:
    control = AimdLimit(512, slow_s=5.0)
    assert control.limit == 512
    for i in range(1000):
        control.on_connect(started=float(i), latency_s=0.1, now=i + 0.1)
    assert control.limit == 512 and control.cuts == 0


def test_aimd_halves_once_per_window_on_timeouts() -> None:
    control = AimdLimit(512, slow_s=5.0, floor=4)
    # 512 connects began at t=0..1 and all time out at t=10..11: one overloaded window, one cut
    for i in range(512):
        control.on_congestion(started=i / 512, now=10.0 + i / 512)
    assert control.limit == 256 and control.cuts == 1
    # the next window (begun after the cut) still times out: another cut
    control.on_congestion(started=11.5, now=21.5)
    assert control.limit == 128 and control.cuts == 2
    for k in range(20):
        control.on_congestion(started=100.0 + k * 20, now=110.0 + k * 20)
    assert control.limit == 4 and control.lowest == 4  # never below the floor


def test_aimd_a_slow_connect_counts_as_congestion() -> None:
    control = AimdLimit(100, slow_s=5.0)
    control.on_connect(started=0.0, latency_s=4.9, now=4.9)
    assert control.limit == 100
    control.on_connect(started=1.0, latency_s=6.0, now=7.0)
    assert control.limit == 50 and control.cuts == 1


def test_aimd_grows_back_additively_after_a_cut() -> None:
    control = AimdLimit(64, slow_s=5.0, increase=1.0)
    control.on_congestion(started=0.0, now=10.0)
    assert control.limit == 32
    t = 11.0
    for _ in range(32):  # one window of fast connects: +1
        control.on_connect(started=t, latency_s=0.1, now=t + 0.1)
        t += 0.1
    assert control.value == pytest.approx(33.0, abs=0.05)
    for _ in range(10_000):
        control.on_connect(started=t, latency_s=0.1, now=t + 0.1)
    assert control.limit == 64  # back at the ceiling, not past it


def test_gate_admits_up_to_the_limit_and_follows_it() -> None:
    async def scenario() -> None:
        control = AimdLimit(3, slow_s=1.0, floor=1)
        gate = Gate(control)
        release = [asyncio.Event() for _ in range(8)]
        entered: list[int] = []
        peak = 0

        async def worker(i: int) -> None:
            nonlocal peak
            async with gate:
                entered.append(i)
                peak = max(peak, gate.in_flight)
                await release[i].wait()

        tasks = [asyncio.create_task(worker(i)) for i in range(8)]
        for _ in range(5):
            await asyncio.sleep(0)
        assert entered == [0, 1, 2]  # first come, first served
        control.on_congestion(started=0.0, now=1.0)  # limit 3 -> 1
        release[0].set()
        release[1].set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert entered == [0, 1, 2] and gate.in_flight == 1  # 2 still holds; nobody else above the limit
        release[2].set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert entered == [0, 1, 2, 3]
        control.value = 3.0  # grown back: the next release hands out every free slot
        release[3].set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert entered == [0, 1, 2, 3, 4, 5, 6]
        tasks[7].cancel()  # a waiter cancelled while queued leaves no slot taken
        for i in (4, 5, 6):
            release[i].set()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert gate.in_flight == 0 and peak == 3

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_cli_result_table_shows_attempts_when_a_node_needed_more_than_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import io

    import cli.render
    from cli.common import show_operation

    def shown(results: dict[str, dict[str, object]]) -> str:
        buffer = io.StringIO()
        monkeypatch.setattr(
            cli.render, "out", cli.render.SafeConsole(file=buffer, width=200, color_system=None)
        )
        show_operation({"id": 7, "kind": "inventory", "state": "succeeded", "results": results}, False)
        return buffer.getvalue()

    retried = shown(
        {
            "n1": {"status": "ok", "message": "fine", "attempts": 1},
            "n2": {"status": "ok", "message": "fine", "attempts": 3},
        }
    )
    assert "ATTEMPTS" in retried
    cells = [[c.strip() for c in line.strip("│").split("│")] for line in retried.splitlines() if "│" in line]
    assert [c[:3] for c in cells] == [
        ["n1", "ok", "1"],
        ["n2", "ok", "3"],
    ]
    assert "ATTEMPTS" not in shown({"n1": {"status": "ok", "message": "fine", "attempts": 1}})
