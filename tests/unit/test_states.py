"""The lifecycle table, tested exhaustively: every state × every verb is allowed or refused."""

from __future__ import annotations

import itertools

import pytest

from bcm.domain.states import PUBLIC_VERBS, TRANSITIONS, State, Verb, allowed_verbs, next_state
from bcm.errors import IllegalTransition

# The expected table, written out independently of the implementation: verb -> {from: to}.
EXPECTED: dict[Verb, dict[State, State]] = {
    Verb.REGISTER: {State.DISCOVERED: State.REGISTERED},
    Verb.INVENTORY: {
        State.REGISTERED: State.INVENTORIED,
        State.INVENTORIED: State.INVENTORIED,
        State.FAILED: State.INVENTORIED,
        State.UNREACHABLE: State.INVENTORIED,
        State.BOOTED: State.BOOTED,
        State.READY: State.READY,
        State.DRAINING: State.DRAINING,
        State.DRAINED: State.DRAINED,
    },
    Verb.PROVISION: {s: State.PROVISIONING for s in (State.REGISTERED, State.INVENTORIED, State.FAILED)},
    Verb.REIMAGE: {
        s: State.PROVISIONING
        for s in (State.BOOTED, State.READY, State.DRAINING, State.DRAINED, State.FAILED, State.UNREACHABLE)
    },
    Verb.DRAIN: {
        State.BOOTED: State.DRAINED,
        State.READY: State.DRAINED,
        State.DRAINED: State.DRAINED,
        State.DRAINING: State.DRAINING,
    },
    Verb.RESUME: {State.DRAINING: State.READY, State.DRAINED: State.READY},
    Verb.RETIRE: {s: State.RETIRED for s in State if s is not State.RETIRED},
}


@pytest.mark.parametrize(("state", "verb"), list(itertools.product(State, sorted(PUBLIC_VERBS))))
def test_every_state_and_public_verb(state: State, verb: Verb) -> None:
    expected = EXPECTED[verb].get(state)
    if expected is None:
        with pytest.raises(IllegalTransition) as exc:
            next_state("gpu07", state, verb)
        assert (
            "gpu07" in exc.value.message
            and state.value in exc.value.message
            and verb.value in exc.value.message
        )
        assert exc.value.status_code == 409
        assert verb not in allowed_verbs(state)
    else:
        assert next_state("gpu07", state, verb) is expected
        assert verb in allowed_verbs(state)


def test_internal_events_reach_the_working_states() -> None:
    assert next_state("n", State.PROVISIONING, Verb.BOOT_DONE) is State.BOOTED
    assert next_state("n", State.BOOTED, Verb.JOIN_DONE) is State.READY
    assert next_state("n", State.INVENTORIED, Verb.JOIN_DONE) is State.READY
    assert next_state("n", State.DRAINED, Verb.JOIN_DONE) is State.DRAINED
    assert next_state("n", State.READY, Verb.LOST) is State.UNREACHABLE
    assert next_state("n", State.DRAINING, Verb.DRAIN_DONE) is State.DRAINED
    with pytest.raises(IllegalTransition):
        next_state("n", State.RETIRED, Verb.FAIL)


def test_every_state_can_be_left_except_retired() -> None:
    for state in State:
        outgoing = {to for (s, _), to in TRANSITIONS.items() if s is state and to is not state}
        assert bool(outgoing) is (state is not State.RETIRED), state


def test_unknown_verb_is_refused() -> None:
    with pytest.raises(IllegalTransition):
        next_state("n", State.READY, "explode")
