"""Node lifecycle: states, verbs and the one transition table between them.

The API takes verbs, never raw state writes. A verb either moves the node at once (``drain``,
``resume``, ``retire``, ``register``) or starts work whose outcome is ``target_state`` until the
work reports back through an internal event (``inventory``, ``provision``, ``reimage``).
"""

from __future__ import annotations

from enum import StrEnum

from bcm.errors import IllegalTransition


class State(StrEnum):
    DISCOVERED = "discovered"
    """Seen by PXE or a scan; not yet accepted by an admin."""
    REGISTERED = "registered"
    """Known by name/MAC/IP; hardware not yet collected."""
    INVENTORIED = "inventoried"
    """Hardware facts collected and stored."""
    PROVISIONING = "provisioning"
    """An image is being booted or synced onto the node."""
    BOOTED = "booted"
    """Running its image; the agent has called back."""
    READY = "ready"
    """Booted and accepted into its workload manager."""
    DRAINING = "draining"
    """Takes no new jobs; jobs are still running."""
    DRAINED = "drained"
    """Takes no new jobs and runs none."""
    FAILED = "failed"
    """The last operation failed; see last_error."""
    UNREACHABLE = "unreachable"
    """Did not answer over the network."""
    RETIRED = "retired"
    """Out of service for good; kept for the record."""


class Verb(StrEnum):
    # verbs an admin may send
    REGISTER = "register"
    INVENTORY = "inventory"
    PROVISION = "provision"
    REIMAGE = "reimage"
    DRAIN = "drain"
    RESUME = "resume"
    RETIRE = "retire"
    # internal events reported by work in progress
    INVENTORY_DONE = "inventory_done"
    BOOT_DONE = "boot_done"
    JOIN_DONE = "join_done"
    DRAIN_DONE = "drain_done"
    FAIL = "fail"
    LOST = "lost"


PUBLIC_VERBS: frozenset[Verb] = frozenset(
    {Verb.REGISTER, Verb.INVENTORY, Verb.PROVISION, Verb.REIMAGE, Verb.DRAIN, Verb.RESUME, Verb.RETIRE}
)

S = State
_ALIVE = (S.BOOTED, S.READY, S.DRAINING, S.DRAINED)

# (state, verb) -> next state.  Anything absent is illegal.
TRANSITIONS: dict[tuple[State, Verb], State] = {
    (S.DISCOVERED, Verb.REGISTER): S.REGISTERED,
    # inventory of a node that is not yet in service makes it "inventoried"; a running node keeps its state
    **{(s, Verb.INVENTORY): S.INVENTORIED for s in (S.REGISTERED, S.INVENTORIED, S.FAILED, S.UNREACHABLE)},
    **{(s, Verb.INVENTORY): s for s in _ALIVE},
    **{
        (s, Verb.INVENTORY_DONE): S.INVENTORIED
        for s in (S.REGISTERED, S.INVENTORIED, S.FAILED, S.UNREACHABLE)
    },
    **{(s, Verb.INVENTORY_DONE): s for s in _ALIVE},
    **{(s, Verb.PROVISION): S.PROVISIONING for s in (S.REGISTERED, S.INVENTORIED, S.FAILED)},
    **{(s, Verb.REIMAGE): S.PROVISIONING for s in (*_ALIVE, S.FAILED, S.UNREACHABLE)},
    (S.PROVISIONING, Verb.BOOT_DONE): S.BOOTED,
    # joining a workload manager puts a node in service; SSH-inventoried nodes join without a bcm boot
    (S.INVENTORIED, Verb.JOIN_DONE): S.READY,
    (S.BOOTED, Verb.JOIN_DONE): S.READY,
    (S.DRAINING, Verb.JOIN_DONE): S.DRAINING,
    (S.DRAINED, Verb.JOIN_DONE): S.DRAINED,
    (S.READY, Verb.JOIN_DONE): S.READY,
    **{(s, Verb.DRAIN): S.DRAINED for s in (S.BOOTED, S.READY, S.DRAINED)},
    (S.DRAINING, Verb.DRAIN): S.DRAINING,
    (S.READY, Verb.DRAIN_DONE): S.DRAINING,
    (S.DRAINING, Verb.DRAIN_DONE): S.DRAINED,
    **{(s, Verb.RESUME): S.READY for s in (S.DRAINING, S.DRAINED)},
    **{(s, Verb.RETIRE): S.RETIRED for s in State if s is not S.RETIRED},
    **{(s, Verb.FAIL): S.FAILED for s in State if s is not S.RETIRED},
    **{(s, Verb.LOST): S.UNREACHABLE for s in State if s not in (S.RETIRED, S.DISCOVERED)},
}


def next_state(node_name: str, state: State | str, verb: Verb | str) -> State:
    """The state a verb leads to, or IllegalTransition naming the node, its state and the verb."""
    try:
        current, action = State(state), Verb(verb)
    except ValueError as exc:
        raise IllegalTransition(f"node {node_name}: unknown state or verb ({state!r}, {verb!r})") from exc
    try:
        return TRANSITIONS[(current, action)]
    except KeyError:
        allowed = sorted(v.value for (s, v) in TRANSITIONS if s is current and v in PUBLIC_VERBS)
        raise IllegalTransition(
            f"node {node_name} is {current.value}: cannot {action.value}"
            f" (allowed: {', '.join(allowed) or 'nothing'})"
        ) from None


def allowed_verbs(state: State) -> list[Verb]:
    """Public verbs an admin may send to a node in this state."""
    return sorted(v for (s, v) in TRANSITIONS if s is state and v in PUBLIC_VERBS)
