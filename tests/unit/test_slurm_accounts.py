"""The sacctmgr diff of the tenancy tree, from sacctmgr -nP output in the shape Slurm prints it."""

from __future__ import annotations

from bcm.drivers.wlm import slurm_accounts as accts
from bcm.drivers.wlm.base import AccountSpec
from bcm.drivers.wlm.slurm import parse_usage

WANT = [
    AccountSpec("research", None, 10, None),
    AccountSpec("nlp", "research", 9, 3, ("alice", "bob")),
    AccountSpec("vision", "research", 1, 1, ("alice",)),
]
ACCOUNTS = "research|bcm\nnlp|bcm\nvision|bcm\nroot|root\nlegacy|physics\n"
ASSOC = (
    "root||||\n"
    "root|root||1|\n"
    "legacy||root|1|\n"
    "research||root|10|\n"
    "nlp||research|9|gres/gpu=3\n"
    "nlp|alice||1|\n"
    "nlp|bob||1|\n"
    "vision||research|1|gres/gpu=1\n"
    "vision|alice||1|\n"
)
USERS = "alice|vision\nbob|nlp\nroot|root\n"


def _plan(
    want: list[AccountSpec], assoc: str = ASSOC, previous: list[AccountSpec] | None = None
) -> list[tuple[str, str, str, bool]]:
    changes, _ = accts.diff(
        "lab", want, accts.parse(ACCOUNTS, assoc, USERS), previous if previous is not None else WANT
    )
    return [(c.action, c.kind, c.name, c.drift) for c in changes]


def test_in_step_means_no_changes() -> None:
    assert _plan(WANT) == []


def test_empty_slurm_gets_everything_parents_first() -> None:
    changes, notes = accts.diff("lab", WANT, accts.parse("root|root\n", "root||||\n", ""), [])
    assert [(c.action, c.kind, c.name) for c in changes] == [
        ("add", "account", "research"),
        ("add", "account", "nlp"),
        ("add", "account", "vision"),
        ("add", "user", "alice"),
        ("add", "user", "alice"),
        ("add", "user", "bob"),
    ]
    assert "parent=root" in changes[0].command and "organization=bcm" in changes[0].command
    assert "grptres=gres/gpu=3" in changes[1].command and notes == []


def test_hand_edit_is_drift_and_model_change_is_not() -> None:
    edited = ASSOC.replace("nlp||research|9|gres/gpu=3", "nlp||research|5|gres/gpu=3")
    assert _plan(WANT, edited) == [("modify", "account", "nlp", True)]
    wider = [WANT[0], AccountSpec("nlp", "research", 9, 4, ("alice", "bob")), WANT[2]]
    assert _plan(wider) == [("modify", "account", "nlp", False)]


def test_removed_project_goes_users_first_and_defaults_move() -> None:
    changes, _ = accts.diff("lab", WANT[:2], accts.parse(ACCOUNTS, ASSOC, USERS), WANT)
    assert [(c.action, c.kind, c.name) for c in changes] == [
        ("modify", "user", "alice"),  # her default was vision; nlp is left
        ("remove", "user", "alice"),
        ("remove", "account", "vision"),
    ]
    assert "defaultaccount=nlp" in changes[0].command and "account=vision" in changes[1].command


def test_last_association_removes_the_user_and_foreign_accounts_are_left_alone() -> None:
    only_research = [AccountSpec("research", None, 10, None), AccountSpec("legacy", "research", 1, None)]
    changes, notes = accts.diff("lab", only_research, accts.parse(ACCOUNTS, ASSOC, USERS), WANT)
    got = [(c.action, c.kind, c.name) for c in changes]
    assert ("remove", "user", "bob") in got and "account=" not in changes[
        got.index(("remove", "user", "bob"))
    ].command
    assert got[-2:] == [("remove", "account", "nlp"), ("remove", "account", "vision")]
    assert not any(name == "legacy" for _, _, name in got)
    assert notes and "legacy" in notes[0]


def test_enforcing() -> None:
    assert accts.enforcing("AccountingStorageEnforce = associations,limits,qos\n")
    assert not accts.enforcing("AccountingStorageEnforce = none\n")


def test_usage() -> None:
    sshare = "nlp||9|0.900000|1200|0.600000|0.400000\nnlp|bob|1|0.5|10|0.1|0.2\n"
    squeue = "nlp|RUNNING|1|gres/gpu:1\nnlp|RUNNING|2|gres/gpu:h100:2\nnlp|PENDING|1|gres/gpu:1\nother|RUNNING|1|gpu:1\n"
    got = parse_usage(["nlp"], sshare, squeue)["nlp"]
    assert (got.raw_shares, got.raw_usage, got.fairshare) == (9, 1200, 0.4)
    assert (got.gpus_running, got.gpus_pending) == (5, 1)
