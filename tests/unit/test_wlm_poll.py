"""``poll_states``: the one bounded poll of a workload manager's node states that waiting for registration
and settling after a verification job share."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bcm.drivers import wlm
from bcm.drivers.wlm.base import poll_registered
from bcm.errors import RetryableDriverError


class Answers:
    """The controller's answers in turn (an exception is raised); the last repeats."""

    def __init__(self, *answers: Any) -> None:
        self.answers, self.calls = list(answers), 0

    async def node_states(self, ssh: Any, controller: Any) -> dict[str, wlm.WlmNodeState]:
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        if isinstance(answer, Exception):
            raise answer
        return {n: wlm.WlmNodeState(s) for n, s in answer.items()}

    def is_responding(self, state: wlm.WlmNodeState | None) -> bool:
        return state is not None and state.state == "idle"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_registered_waits_through_an_unanswering_controller_until_every_node_responds() -> None:
    m = Answers(RetryableDriverError("refused"), {"n1": "idle"}, {"n1": "idle", "n2": "idle"})
    got = run(poll_registered(m, None, None, ["n1", "n2"], timeout_s=30, interval_s=0))  # type: ignore[arg-type]
    assert m.calls == 3 and set(got) == {"n1", "n2"}


def test_the_deadline_returns_the_last_states_seen_or_raises_if_the_controller_never_answered() -> None:
    m = Answers({"n1": "down"})
    got = run(poll_registered(m, None, None, ["n1"], timeout_s=0.05, interval_s=0.01))  # type: ignore[arg-type]
    assert got["n1"].state == "down" and m.calls >= 2
    silent = Answers(RetryableDriverError("refused"))
    with pytest.raises(RetryableDriverError):
        run(poll_registered(silent, None, None, ["n1"], timeout_s=0.05, interval_s=0.01))  # type: ignore[arg-type]


def test_any_condition_on_the_states() -> None:
    m = Answers({"n1": "allocated"}, {"n1": "mixed"}, {"n1": "idle"})

    def settled(states: dict[str, wlm.WlmNodeState]) -> bool:
        return bool(states) and states["n1"].state == "idle"

    got = run(wlm.poll_states(m, None, None, settled, timeout_s=30, interval_s=0))  # type: ignore[arg-type]
    assert m.calls == 3 and got["n1"].state == "idle"
