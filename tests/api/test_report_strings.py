"""A health report whose strings hold NUL or other control characters is a 422 naming the field and
stores nothing, on SQLite and PostgreSQL (NUL was a 500 on PostgreSQL; escapes reached terminals)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.engine import Engine

from bcm.models.health import HealthRecord
from tests.api.test_health_api import add_nodes, count, node_token, post, report


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("uuid", "GPU-\x00bad"),
        ("name", "H100 \x1b]0;pwned\x07"),
        ("serial", "1\x9b31m"),
        ("pci_bus_id", "0000:\x7f"),
    ],
)
def test_control_characters_in_a_gpus_strings_are_a_422_naming_the_field(
    api: Any, engine: Engine, where: str, value: str
) -> None:
    add_nodes(api, engine, "gpu01")
    tok = node_token(api, "gpu01")
    body = report("gpu01")
    body["gpus"][1][where] = value
    r = post(api, tok, body)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == f"gpus.1.{where}"
    assert count(engine, HealthRecord) == 0
    assert post(api, tok, report("gpu01")).status_code == 202
