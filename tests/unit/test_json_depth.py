"""bcm.api.limits.json_depth against a reference that parses the JSON, on the cases that trip scanners."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bcm.api.limits import json_depth


def parsed_depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((parsed_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((parsed_depth(v) for v in value), default=0)
    return 0


CASES = [
    "1",
    '"[[[{{{"',
    "[]",
    '{"a": [1, 2, {"b": []}]}',
    '{"k\\"[": "v\\\\", "x": [[["\\\\\\"]]]"]]]}',  # escaped quotes and backslashes around brackets
    '["\\\\", ["\\\\\\\\"], "\\"]"]',
    '{"a": "\\n[\\t{", "b": {"c": {"d": "\\u005b"}}}',
    "[" * 40 + "]" * 40,
    '[{"a": "' + "]" * 50 + '"}]',
]


@pytest.mark.parametrize("text", CASES)
def test_depth_matches_a_parser(text: str) -> None:
    assert json_depth(text.encode()) == parsed_depth(json.loads(text))


def test_a_real_health_report_is_measured_right() -> None:
    from bcm.agent.collector import collect
    from bcm.agent.fake_nvml import FakeNvml
    from bcm.lab.fakegpu import RECORDED_NVML

    nv = FakeNvml.from_file(RECORDED_NVML / "h100_sxm_565.json")
    nv.init()
    report = json.dumps(dict(collect(nv, 8, hostname="x")))
    nv.shutdown()
    assert json_depth(report.encode()) == parsed_depth(json.loads(report))


def test_a_limit_stops_the_count_one_past_it() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    assert json_depth(deep, 32) == 33
    assert json_depth(b'{"a": [1, {"b": "[[[["}]}', 32) == 3
    assert json_depth(b"[[[", 32) == 0  # unbalanced: left to the parser
