"""A refused image download costs nothing: the transfer limits are checked before any database read or
``stat`` (a boot storm's retries must not load the database), and the 503 says when to come back."""

from __future__ import annotations

import re
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event

from bcm.api.boot import images
from bcm.api.boot.images import Transfers, transfer_limit
from bcm.db import session_scope
from bcm.settings import Settings


def test_a_download_over_the_limit_is_refused_before_any_query(
    api: TestClient, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    statements: list[str] = []  # on the image tables (the server's own loops query others meanwhile)
    sessions: list[Any] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if re.search(r"\b(from|join)\s+image(artifact)?\b", statement, re.I):
            statements.append(statement)

    def opened(eng: Any) -> Any:
        sessions.append(eng)
        return session_scope(eng)

    monkeypatch.setattr(images, "session_scope", opened)

    full = Transfers(limit=1, per_client=1)
    full.enter("198.18.0.9")  # another machine holds the only slot
    api.app.state.image_transfers = full  # type: ignore[attr-defined]
    event.listen(engine, "before_cursor_execute", count)
    try:
        # an image that does not exist: answered 503, not 404, so nothing was looked up
        refused = api.get("/boot/v1/images/none/1/rootfs.squashfs", headers={"Authorization": ""})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
        assert "1 image downloads in flight" in refused.json()["message"]
        assert statements == [] and sessions == []
        full.leave("198.18.0.9")
        looked_up = api.get("/boot/v1/images/none/1/rootfs.squashfs", headers={"Authorization": ""})
        assert looked_up.status_code == 404 and statements and sessions  # with a free slot it is looked up
        assert full.active == 0  # and the slot came back with the 404
    finally:
        event.remove(engine, "before_cursor_execute", count)


def test_the_default_limit_admits_every_node_bcm_provisions_at_once() -> None:
    assert transfer_limit(Settings()) >= Settings().pxe.max_concurrent
    assert transfer_limit(Settings(pxe={"max_concurrent": 1000})) == 1000
    assert transfer_limit(Settings(images={"max_transfers": 8}, pxe={"max_concurrent": 1000})) == 8  # as set
