"""What an inventory records per node: a host reached after transient connect failures says how many
connections it took (``bcm node inventory --wait`` shows it), and one reached at once does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlmodel import Session

from bcm.drivers import ssh
from bcm.services import inventory

FACTS = (Path(__file__).resolve().parents[1] / "data" / "facts" / "vm-debian12.facts").read_text()


def test_attempts_are_recorded_when_a_host_needed_retries(api: TestClient, engine: Any) -> None:
    for name in ("n1", "n2", "n3"):
        assert api.post("/api/v1/nodes", json={"name": name}).status_code == 201
    with Session(engine) as s:
        retried = inventory.store_result(
            s, ssh.HostResult("n1", ssh.HostStatus.OK, 0, FACTS, attempts=3), "t"
        )
        first = inventory.store_result(s, ssh.HostResult("n2", ssh.HostStatus.OK, 0, FACTS), "t")
        lost = inventory.store_result(
            s, ssh.HostResult("n3", ssh.HostStatus.UNREACHABLE, error="no route", attempts=4), "t"
        )
        s.commit()
    assert retried["status"] == "ok" and retried["attempts"] == 3, retried
    assert first["status"] == "ok" and "attempts" not in first, first
    assert lost["status"] == "unreachable" and lost["attempts"] == 4, lost
