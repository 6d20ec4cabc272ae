"""Events about a node's agent token name the token by id, never by characters of its secret."""

from __future__ import annotations

from typing import Any

from sqlmodel import Session, select

from bcm.models.event import Event


def test_a_node_token_event_shows_no_character_of_the_secret(api: Any, engine: Any) -> None:
    assert api.post("/api/v1/nodes/bulk", json={"nodes": "gpu01"}).status_code == 201
    r = api.post("/api/v1/nodes/gpu01/token")
    assert r.status_code == 201, r.text
    secret = r.json()["token"].removeprefix("bcm_")
    with Session(engine) as s:
        (event,) = s.exec(select(Event).where(Event.action == "node.token"))
    assert event.message.startswith("agent token #") and "agent:gpu01" in event.message
    # no run of 5 characters of the secret appears (the old message showed its first 6; a shorter run of a
    # random secret can occur in the message's own words by chance)
    assert not any(secret[i : i + 5] in event.message for i in range(len(secret) - 4)), event.message
