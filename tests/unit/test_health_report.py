"""Server-side validation of the agent's report (bcm.domain.health_report): bounds and malformed input."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from bcm.agent import schema
from bcm.agent.collector import collect
from bcm.agent.fake_nvml import FakeNvml
from bcm.domain.health import Thresholds, Verdict, evaluate
from bcm.domain.health_ingest import Context, judge
from bcm.domain.health_report import HealthReport
from bcm.lab.fakegpu import RECORDED_NVML
from bcm.models.health import RECORD_FIELDS
from tests.paths import set_path

DATA = RECORDED_NVML


def collected(fixture: str = "h100_sxm_565.json") -> dict[str, Any]:
    nv = FakeNvml.from_file(DATA / fixture)
    nv.init()
    nv.push_xid(79, 1)
    nv.register_xid_events()
    raw = nv.wait_xid(0)
    assert raw is not None
    event: schema.XidEvent = {
        "xid": raw.xid,
        "gpu_index": raw.gpu_index,
        "uuid": None,
        "pci_bus_id": None,
        "time": "2024-11-14T07:00:10.000Z",
        "source": "nvml",
        "message": None,
        "recovery_action": None,
    }
    return dict(collect(nv, 3, xid_events=[event], hostname="gpu01", now=1_731_567_614.0))


@pytest.mark.parametrize("fixture", sorted(p.name for p in DATA.glob("*.json")))
def test_every_recorded_fixture_validates_and_round_trips_to_the_rules(fixture: str) -> None:
    report = collected(fixture)
    model = HealthReport.model_validate(report)
    again = model.rules_input()
    assert again["schema"] == 1
    assert again["gpus"] == report["gpus"]

    def shape(node: Any) -> list[Any]:
        return [node.verdict, [(f.code, f.severity) for f in node.findings]] + [
            (g.index, g.verdict, [(r.code, r.severity, r.action) for r in g.reasons]) for g in node.gpus
        ]

    assert shape(evaluate(again)) == shape(evaluate(report))


BAD = [
    ("schema", 2),
    ("gpus", [collected()["gpus"][0]] * (schema.MAX_GPUS + 1)),
    ("xid_events", [collected()["xid_events"][0]] * (schema.MAX_XID_EVENTS + 1)),
    ("errors", ["x"] * (schema.MAX_ERRORS + 1)),
    ("hostname", "h" * (schema.MAX_STRING + 1)),
    ("gpus.0.uuid", "G" * (schema.MAX_STRING + 1)),
    ("gpus.0.nvlinks", collected()["gpus"][0]["nvlinks"] * 3),
    ("gpus.0.ecc.volatile_uncorrected", -1),
    ("gpus.0.utilization_gpu_pct", 101),
    ("gpus.0.index", schema.MAX_GPUS),
    ("gpus.0.remapped_rows", {"correctable": 0}),
    ("gpus.0.surprise", 1),
    ("surprise", 1),
    ("xid_events.0.source", "syslog"),
    ("xid_events.0.time", "yesterday"),
    ("xid_events.0.message", "m" * (schema.MAX_MESSAGE + 1)),
    ("collected_at", None),
    ("gpu_count", "eight"),
    ("gpus.0.uuid", "GPU-\x00"),
    ("gpus.0.name", "H100\x1b]0;pwned\x07"),
    ("gpus.0.serial", "1\x9b2"),
    ("gpus.0.clock_events.0", "sw\x7fthermal"),
    ("hostname", "gpu\n01"),
    ("driver_version", "565\x00"),
    ("xid_events.0.message", "NVRM: Xid\x1b[2J"),
    ("errors", ["nvml: \x1b]8;;http://x\x1b\\link"]),
]


@pytest.mark.parametrize(("path", "value"), BAD, ids=[p for p, _ in BAD])
def test_oversize_or_malformed_reports_are_refused(path: str, value: Any) -> None:
    with pytest.raises(ValidationError):
        HealthReport.model_validate(set_path(copy.deepcopy(collected()), path, value))


def test_missing_required_field_is_refused() -> None:
    report = collected()
    del report["gpus"]
    with pytest.raises(ValidationError):
        HealthReport.model_validate(report)


def test_a_sample_with_only_its_index_is_judged_and_stored_as_readings_not_offered() -> None:
    """What the agent leaves out of a GPU sample is absent, never invented: the rules find nothing in it
    and every reading stored for it is None (NULL), as NVML's NOT_SUPPORTED would be."""
    report = collected()
    report["gpus"] = [{"index": 0}, {**report["gpus"][1], "index": 1, "ecc": {}}]
    report["gpu_count"], report["xid_events"] = 2, []
    model = HealthReport.model_validate_json(json.dumps(report))
    assert model.gpus[0] == {"index": 0}
    judged = evaluate(model.rules_input(), expected_gpus=2)
    assert [g.verdict for g in judged.gpus] == [Verdict.OK, Verdict.OK]
    ctx = Context(1, "gpu01", "ready", Thresholds(), 2, None)
    out = judge(ctx, model, resume_after=3, prune_every=10, now=datetime(2026, 12, 5, tzinfo=UTC))
    bare = out.gpu_rows[0]
    assert bare["uuid"] == "gpu01:gpu0" and bare["verdict"] == "OK"
    readings = set(bare) - {
        "node_id",
        "index",
        "uuid",
        "verdict",
        "reasons",
        "xid_count",
        "sampled_at",
        "last_xid",
    }
    assert readings and all(bare[k] is None for k in readings), bare
    assert out.gpu_rows[1]["ecc_sbe_volatile"] is None and out.gpu_rows[1]["temperature_c"] is not None
    stored = dict(zip(RECORD_FIELDS, out.record_row["gpus"][0], strict=True))  # the history's reading
    assert stored["index"] == 0 and stored["uuid"] == "gpu01:gpu0" and stored["verdict"] == "OK"
    assert stored["temperature_c"] is None and stored["ecc_dbe_volatile"] is None


def test_free_text_keeps_its_lines_and_tabs() -> None:
    report = collected()
    report["errors"] = ["nvml: failed\n\tretrying"]
    report["xid_events"][0]["message"] = "NVRM: Xid (PCI:0000:1b:00): 79\n"
    assert HealthReport.model_validate(report).errors == ["nvml: failed\n\tretrying"]
