"""Verbs are compare-and-set: a verb checked against a state that changed before its write moves nothing."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import update
from sqlmodel import Session

from bcm.db import session_scope
from bcm.errors import IllegalTransition
from bcm.models.node import Node, NodeBulkCreate
from bcm.services import nodes


def _states(engine: Any, names: list[str]) -> list[str]:
    with Session(engine) as s:
        return [n.provision_state for n in nodes.get_many(s, names)]


def test_a_verb_that_lost_the_race_writes_nothing_and_names_the_new_state(engine: Any) -> None:
    with session_scope(engine) as s:
        nodes.bulk_create(s, NodeBulkCreate(nodes="r[1-3]"), "test")
        s.execute(update(Node).values(provision_state="drained"))  # type: ignore[arg-type]
    names = ["r1", "r2", "r3"]
    slow = Session(engine, expire_on_commit=False)
    try:
        seen = nodes.check_verb(slow, names, "resume")  # the slow request has read "drained" for all
        with session_scope(engine) as fast:
            nodes.apply_verb(fast, ["r2"], "retire", "test")  # another request retires r2 meanwhile
        with pytest.raises(IllegalTransition) as lost:
            nodes.apply_verb(slow, names, "resume", "test")
        slow.rollback()
        assert seen  # the loaded nodes stay in the session, as they do within one apply_verb call
    finally:
        slow.close()
    assert "r2 is now retired" in lost.value.message
    assert _states(engine, names) == ["drained", "retired", "drained"]  # all or nothing: r1, r3 unmoved


def test_a_verb_loses_to_a_lock_taken_after_its_check(engine: Any) -> None:
    with session_scope(engine) as s:
        nodes.bulk_create(s, NodeBulkCreate(nodes="k1"), "test")
        s.execute(update(Node).values(provision_state="ready"))  # type: ignore[arg-type]
    slow = Session(engine, expire_on_commit=False)
    try:
        seen = nodes.check_verb(slow, ["k1"], "drain")
        with session_scope(engine) as other:
            nodes.acquire_locks(other, ["k1"], "op-other", ttl_s=60)
        with pytest.raises(IllegalTransition) as lost:
            nodes.apply_verb(slow, ["k1"], "drain", "test")
        slow.rollback()
        assert seen  # the loaded nodes stay in the session, as they do within one apply_verb call
    finally:
        slow.close()
    assert "locked meanwhile by op-other" in lost.value.message
    assert _states(engine, ["k1"]) == ["ready"]
