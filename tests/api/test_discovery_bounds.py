"""What one unauthenticated discovery post may store, on SQLite and PostgreSQL: facts hold no control
characters and no unbounded integers (a 422 naming the field, nothing stored, never a 500), one machine's
facts and all discovered machines' facts are bounded in bytes, refusals are one event per client a minute,
and a category's discovery rule names only so many machines that never went further."""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, select

from bcm.domain.facts import HardwareFacts
from bcm.models.event import Event
from bcm.models.node import Node
from bcm.services import events as event_svc

FACTS: dict[str, Any] = {
    "format_version": 1,
    "cpu": {"model": "QEMU Virtual CPU", "threads": 4},
    "memory_bytes": 1 << 30,
    "nics": [{"name": "ens3", "mac": "52:54:00:aa:00:01", "mtu": 1500}],
}


@pytest.fixture(autouse=True)
def fresh_throttle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no refusal counted in the last minute (the throttle is per process)."""
    monkeypatch.setattr(event_svc, "_throttle", event_svc._Throttle())


def post(api: TestClient, mac: str, facts: dict[str, Any]) -> Any:
    return api.post("/boot/v1/discover", json={"mac": mac, "facts": facts}, headers={"Authorization": ""})


def stored(engine: Any) -> list[str]:
    with Session(engine) as s:
        return sorted(s.exec(select(Node.name)))


def refusals(engine: Any) -> list[Event]:
    with Session(engine) as s:
        return [
            e
            for e in s.exec(select(Event).where(Event.action == "node.discovered"))
            if "refused" in e.message
        ]


def noise(n: int) -> str:
    """``n`` characters nothing compresses (PostgreSQL would compress a repeated string to nothing)."""
    return base64.b64encode(os.urandom(n))[:n].decode()


@pytest.mark.parametrize(
    ("facts", "field"),
    [
        ({"nics": [{"name": "eth\x000", "mac": "52:54:00:aa:00:01"}]}, "facts.nics.0.name"),
        ({"dmi": {"product_name": "\x1b]0;pwned\x07"}}, "facts.dmi.product_name"),
        ({"kernel": "6.1\x9b31m"}, "facts.kernel"),
        ({"memory_bytes": int("9" * 4000)}, "facts.memory_bytes"),
        ({"cpu": {"threads": -1}}, "facts.cpu.threads"),
        ({"gpus": [{"index": 0, "uuid": "GPU-\x00"}]}, "facts.gpus.0.uuid"),
        ({"hostname": "x" * 300}, "facts.hostname"),
        ({"warnings": ["w"] * 5000}, "facts.warnings"),
    ],
)
def test_bad_facts_are_a_422_naming_the_field_and_store_nothing(
    api: TestClient, engine: Any, facts: dict[str, Any], field: str
) -> None:
    before = stored(engine)
    r = post(api, "52:54:00:aa:00:01", facts)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == field
    assert stored(engine) == before


def test_one_machines_facts_are_bounded_in_bytes(api: TestClient, engine: Any, settings: Any) -> None:
    settings.pxe.max_facts_bytes = 4096
    big = {
        **FACTS,
        "pci_devices": [{"slot": f"0000:00:{i:02x}.0", "device_name": noise(200)} for i in range(20)],
    }
    for i in range(3):
        r = post(api, f"52:54:00:aa:00:0{i}", big)
        assert r.status_code == 422, r.text
        assert r.json()["field"] == "facts" and "BCM_PXE__MAX_FACTS_BYTES" in r.json()["message"]
    assert stored(engine) == []
    # three refusals from one client in a minute: one event now, the rest summed later
    assert len(refusals(engine)) == 1
    assert post(api, "52:54:00:aa:00:01", FACTS).status_code == 202


def test_all_discovered_facts_are_bounded_in_bytes(api: TestClient, engine: Any, settings: Any) -> None:
    # mostly noise: PostgreSQL counts what it stores, compressed, and noise does not compress
    facts = {**FACTS, "warnings": [noise(250) for _ in range(16)]}
    size = len(json.dumps(HardwareFacts.model_validate(facts).model_dump(mode="json")))
    settings.pxe.max_discovered_bytes = size * 5 // 2  # two machines' facts, not three
    assert post(api, "52:54:00:aa:00:01", facts).status_code == 202
    assert post(api, "52:54:00:aa:00:02", facts).status_code == 202
    refused = post(api, "52:54:00:aa:00:03", facts)
    assert refused.status_code == 409 and "BCM_PXE__MAX_DISCOVERED_BYTES" in refused.json()["message"]
    assert stored(engine) == ["mac-525400aa0001", "mac-525400aa0002"]
    # a discovered machine posting again replaces its own facts: not counted twice
    assert post(api, "52:54:00:aa:00:02", facts).status_code == 202
    assert len(refusals(engine)) == 1
    # assigning one makes room
    assert (
        api.post("/api/v1/discovered/assign", json={"mac": "52:54:00:aa:00:01", "name": "gpu01"}).status_code
        == 200
    )
    assert post(api, "52:54:00:aa:00:03", facts).status_code == 202


def test_a_discovery_rule_names_only_so_many_machines_that_never_went_further(
    api: TestClient, engine: Any, settings: Any
) -> None:
    settings.pxe.max_rule_registered = 2
    r = api.post(
        "/api/v1/categories",
        json={"name": "dgx", "discover_mac_prefix": "52:54:00:aa", "discover_names": "dgx[01-50]"},
    )
    assert r.status_code == 201, r.text
    answers = [post(api, f"52:54:00:aa:00:{i:02x}", FACTS).json() for i in range(1, 6)]
    assert [(a["node"], a["state"]) for a in answers] == [
        ("dgx01", "registered"),
        ("dgx02", "registered"),
        ("mac-525400aa0003", "discovered"),
        ("mac-525400aa0004", "discovered"),
        ("mac-525400aa0005", "discovered"),
    ]
    with Session(engine) as s:
        messages = [e.message for e in s.exec(select(Event).where(Event.action == "node.discovered"))]
    assert sum("never provisioned (limit 2); left discovered" in m for m in messages) == 3
    # a name the rule handed out is given back (the machine removed): the rule names the next machine
    assert api.delete("/api/v1/nodes", params={"nodes": "dgx02"}).status_code == 200
    assert post(api, "52:54:00:aa:00:06", FACTS).json() == {
        "node": "dgx02",
        "state": "registered",
        "assigned": True,
        "provisioning": False,
    }
    # machines the admin registered in the category without the rule's MAC prefix do not count
    assert api.post("/api/v1/nodes/bulk", json={"nodes": "gpu[01-03]", "category": "dgx"}).status_code in (
        200,
        201,
    )
    assert post(api, "52:54:00:bb:00:01", FACTS).json()["state"] == "discovered"  # no rule matches this MAC
