"""Table-driven tests of the pure GPU health rules (bcm.domain.health)."""

from __future__ import annotations

import copy
import datetime as dt
import json
from typing import Any

import pytest

from bcm.domain.health import (
    XID_RULES,
    Action,
    Thresholds,
    Verdict,
    evaluate,
    evaluate_gpu,
    staleness,
    worst,
)
from bcm.errors import InvalidInput

OK, UNKNOWN, WARN, FAIL = Verdict.OK, Verdict.UNKNOWN, Verdict.WARN, Verdict.FAIL


def healthy_gpu(index: int = 0) -> dict[str, Any]:
    """An H100 SXM sample as the agent reports it (values of bcm/lab/recorded_nvml/h100_sxm_565.json)."""
    return {
        "index": index,
        "uuid": f"GPU-b42dd28e-ffdd-8720-1df0-98bd8cdc05b{index}",
        "name": "NVIDIA H100 80GB HBM3",
        "serial": "1654423001593",
        "pci_bus_id": f"0000:{0x18 + index:02x}:00.0",
        "vbios_version": "96.00.74.00.01",
        "lost": False,
        "temperature_c": 30,
        "temperature_slowdown_c": 89,
        "temperature_shutdown_c": 95,
        "power_draw_w": 100.89,
        "power_limit_w": 700.0,
        "utilization_gpu_pct": 0,
        "utilization_memory_pct": 0,
        "memory_total_mib": 81559,
        "memory_used_mib": 1,
        "ecc_enabled": True,
        "ecc": {
            "volatile_corrected": 0,
            "volatile_uncorrected": 0,
            "aggregate_corrected": 0,
            "aggregate_uncorrected": 0,
        },
        "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False},
        "retired_pages": None,
        "clock_event_reasons": 1,
        "clock_events": ["gpu_idle"],
        "nvlinks": [
            {
                "link": n,
                "active": True,
                "replay": 0,
                "recovery": 0,
                "crc_flit": 0,
                "crc_data": 0,
                "ecc_data": 0,
            }
            for n in range(18)
        ],
        "pcie": {"replay_counter": 7, "gen_current": 5, "gen_max": 5, "width_current": 16, "width_max": 16},
        "recovery_action": "none",
        "unsupported": ["retired_pages.single_bit", "retired_pages.double_bit", "retired_pages.pending"],
        "errors": [],
    }


def report(gpus: list[dict[str, Any]] | None = None, **fields: Any) -> dict[str, Any]:
    gpus = [healthy_gpu(0), healthy_gpu(1)] if gpus is None else gpus
    base: dict[str, Any] = {
        "schema": 1,
        "agent_version": "0.1.0",
        "hostname": "gpu01",
        "collected_at": "2024-11-14T07:00:14.000Z",
        "driver_version": "565.57.01",
        "cuda_driver_version": "12.7",
        "gpu_count": len(gpus),
        "expected_gpu_count": len(gpus),
        "gpus": gpus,
        "xid_events": [],
        "errors": [],
    }
    base.update(fields)
    return base


def xid(number: int, gpu_index: int | None = 0, **fields: Any) -> dict[str, Any]:
    event = {
        "xid": number,
        "gpu_index": gpu_index,
        "uuid": None,
        "pci_bus_id": None,
        "time": "2024-11-14T07:00:10.000Z",
        "source": "nvml",
        "message": None,
        "recovery_action": None,
    }
    event.update(fields)
    return event


def set_path(sample: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(sample)
    node = out
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    last = keys[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return out


def codes(verdict: Any) -> list[str]:
    return [r.code for r in verdict.reasons]


def test_healthy_gpu_and_node_are_ok_without_reasons() -> None:
    node = evaluate(report())
    assert node.verdict == OK
    assert node.findings == ()
    assert [g.verdict for g in node.gpus] == [OK, OK]
    assert all(g.reasons == () for g in node.gpus)


# (field path, value, expected code, severity, action); each row changes one field of a healthy sample.
GPU_RULE_CASES = [
    ("lost", True, "gpu.lost", FAIL, Action.REBOOT_NODE),
    ("ecc.volatile_uncorrected", 1, "ecc.uncorrected", FAIL, Action.RESET_GPU),
    ("remapped_rows.failure", True, "remap.failure", FAIL, Action.REPLACE_GPU),
    ("remapped_rows.pending", True, "remap.pending", WARN, Action.RESET_GPU),
    ("temperature_c", 89, "temperature.slowdown", WARN, Action.CHECK_COOLING),
    ("temperature_c", 94, "temperature.slowdown", WARN, Action.CHECK_COOLING),
    ("temperature_c", 95, "temperature.shutdown", FAIL, Action.CHECK_COOLING),
    ("pcie.gen_current", 4, "pcie.generation", WARN, Action.CHECK_PCIE),
    ("pcie.width_current", 8, "pcie.width", WARN, Action.CHECK_PCIE),
    ("clock_events", ["hw_thermal_slowdown"], "clocks.slowdown", WARN, Action.CHECK_COOLING),
    ("clock_events", ["hw_power_brake_slowdown"], "clocks.slowdown", WARN, Action.CHECK_COOLING),
    ("nvlinks.3.active", False, "nvlink.inactive", WARN, Action.CHECK_NVLINK),
    ("recovery_action", "gpu_reset", "recovery_action", FAIL, Action.RESET_GPU),
    ("recovery_action", "node_reboot", "recovery_action", FAIL, Action.REBOOT_NODE),
    ("recovery_action", "drain_p2p", "recovery_action", WARN, Action.DRAIN_P2P),
    ("recovery_action", "drain_and_reset", "recovery_action", FAIL, Action.DRAIN_AND_RESET),
    (
        "retired_pages",
        {"single_bit": 1, "double_bit": 0, "pending": True},
        "retired_pages.pending",
        WARN,
        Action.RESET_GPU,
    ),
    (
        "retired_pages",
        {"single_bit": 40, "double_bit": 20, "pending": False},
        "retired_pages.limit",
        FAIL,
        Action.REPLACE_GPU,
    ),
]


@pytest.mark.parametrize(("path", "value", "code", "severity", "action"), GPU_RULE_CASES)
def test_each_gpu_rule_fires_on_its_field(
    path: str, value: Any, code: str, severity: Verdict, action: Action
) -> None:
    verdict = evaluate_gpu(set_path(healthy_gpu(), path, value), Thresholds())
    assert codes(verdict) == [code]
    (finding,) = verdict.reasons
    assert (finding.severity, finding.action) == (severity, action)
    assert verdict.verdict == severity
    assert finding.message


# Values just short of each rule: nothing fires.
QUIET_CASES = [
    ("temperature_c", 88),
    ("ecc.aggregate_uncorrected", 5),  # history before the last reset; the rows were remapped since
    ("ecc.volatile_corrected", 10_000),  # corrected errors only warn when a category asks for it
    ("pcie.replay_counter", 10_000),
    ("clock_events", ["gpu_idle", "sw_power_cap"]),
    ("nvlinks.0.crc_flit", 1000),
    ("recovery_action", "none"),
    ("retired_pages", {"single_bit": 1, "double_bit": 0, "pending": False}),  # the V100 recording
    ("remapped_rows.correctable", 1),
]


@pytest.mark.parametrize(("path", "value"), QUIET_CASES)
def test_values_below_the_thresholds_stay_ok(path: str, value: Any) -> None:
    verdict = evaluate_gpu(set_path(healthy_gpu(), path, value), Thresholds())
    assert verdict.verdict == OK
    assert codes(verdict) == []


def test_shutdown_temperature_does_not_also_report_slowdown() -> None:
    verdict = evaluate_gpu(set_path(healthy_gpu(), "temperature_c", 97), Thresholds())
    assert codes(verdict) == ["temperature.shutdown"]


def test_not_supported_fields_are_ignored() -> None:
    gpu = healthy_gpu()
    for key in (
        "temperature_c",
        "temperature_slowdown_c",
        "temperature_shutdown_c",
        "remapped_rows",
        "retired_pages",
        "clock_event_reasons",
        "recovery_action",
        "power_draw_w",
        "ecc_enabled",
    ):
        gpu[key] = None
    gpu["ecc"] = dict.fromkeys(gpu["ecc"])
    gpu["pcie"] = dict.fromkeys(gpu["pcie"])
    gpu["clock_events"] = []
    gpu["nvlinks"] = [dict(link, active=None, replay=None, recovery=None) for link in gpu["nvlinks"]]
    verdict = evaluate_gpu(gpu, Thresholds(temperature_warn_c=80, nvlink_error_warn=0, pcie_replay_warn=0))
    assert verdict.verdict == OK
    assert codes(verdict) == []


# Xid number → severity, action (the table; application Xids are logged, not failed).
XID_CASES = [
    (79, FAIL, Action.REBOOT_NODE),
    (48, FAIL, Action.RESET_GPU),
    (95, FAIL, Action.RESET_GPU),
    (63, WARN, Action.RESET_GPU),
    (64, FAIL, Action.RESET_GPU),
    (74, FAIL, Action.RESET_GPU),
    (94, WARN, Action.RESTART_APP),
    (13, OK, Action.RESTART_APP),
    (31, OK, Action.RESTART_APP),
    (43, OK, Action.RESTART_APP),
    (45, OK, Action.NONE),
    (68, OK, Action.RESTART_APP),
    (12345, WARN, Action.INVESTIGATE),
]


@pytest.mark.parametrize(("number", "severity", "action"), XID_CASES)
def test_xid_table(number: int, severity: Verdict, action: Action) -> None:
    node = evaluate(report(xid_events=[xid(number, gpu_index=1)]))
    gpu0, gpu1 = node.gpus
    assert gpu0.verdict == OK and gpu0.reasons == ()
    (finding,) = gpu1.reasons  # logged even when it does not change the verdict
    assert finding.code == f"xid.{number}"
    assert (finding.severity, finding.action) == (severity, action)
    assert gpu1.verdict == severity
    assert node.verdict == severity


@pytest.mark.parametrize("number", [13, 31, 43, 45, 68])
def test_application_xids_are_logged_but_leave_the_node_ok(number: int) -> None:
    node = evaluate(report(xid_events=[xid(number)] * 3))
    assert node.verdict == OK
    assert codes(node.gpus[0]) == [f"xid.{number}"] * 3


XID_154_CASES = [
    ("none", OK, Action.NONE),
    ("gpu_reset", FAIL, Action.RESET_GPU),
    ("node_reboot", FAIL, Action.REBOOT_NODE),
    ("drain_p2p", WARN, Action.DRAIN_P2P),
    ("drain_and_reset", FAIL, Action.DRAIN_AND_RESET),
    (None, WARN, Action.INVESTIGATE),
    ("something_new", WARN, Action.INVESTIGATE),
]


@pytest.mark.parametrize(("stated", "severity", "action"), XID_154_CASES)
def test_xid_154_acts_on_the_stated_recovery_action(
    stated: str | None, severity: Verdict, action: Action
) -> None:
    node = evaluate(report(xid_events=[xid(154, recovery_action=stated, source="kmsg")]))
    (finding,) = node.gpus[0].reasons
    assert finding.code == "xid.154"
    assert (finding.severity, finding.action) == (severity, action)


def test_xid_is_attributed_by_uuid_when_the_index_is_missing() -> None:
    gpus = [healthy_gpu(0), healthy_gpu(1)]
    node = evaluate(report(gpus, xid_events=[xid(79, gpu_index=None, uuid=gpus[1]["uuid"])]))
    assert [g.verdict for g in node.gpus] == [OK, FAIL]


def test_xid_on_an_unknown_gpu_is_a_node_finding() -> None:
    node = evaluate(report(xid_events=[xid(79, gpu_index=None, pci_bus_id="0000:44:00.0", source="kmsg")]))
    assert [g.verdict for g in node.gpus] == [OK, OK]
    (finding,) = node.findings
    assert (finding.code, finding.severity, finding.action) == ("xid.79", FAIL, Action.REBOOT_NODE)
    assert "0000:44:00.0" in finding.message
    assert node.verdict == FAIL


@pytest.mark.parametrize(
    ("visible", "told", "expected_arg", "finding"),
    [
        (7, 8, None, ("gpu.count", FAIL, Action.REBOOT_NODE)),
        (8, 8, 7, ("gpu.count", WARN, Action.INVESTIGATE)),  # inventory (the argument) wins over the agent
        (2, 8, 2, None),
        (2, None, None, None),
        (2, 2, None, None),
    ],
)
def test_gpu_count_against_expected(
    visible: int, told: int | None, expected_arg: int | None, finding: tuple[str, Verdict, Action] | None
) -> None:
    gpus = [healthy_gpu(i) for i in range(visible)]
    node = evaluate(report(gpus, expected_gpu_count=told), expected_gpus=expected_arg)
    got = [(f.code, f.severity, f.action) for f in node.findings]
    assert got == ([finding] if finding else [])
    assert node.verdict == (finding[1] if finding else OK)


def test_no_nvml_is_unknown_alone_and_fail_when_gpus_are_expected() -> None:
    broken = report([], errors=["NVML init failed: Driver Not Loaded"], expected_gpu_count=None)
    assert evaluate(broken).verdict == UNKNOWN
    assert evaluate(broken, expected_gpus=8).verdict == FAIL


def test_node_verdict_is_the_worst_gpu() -> None:
    warn = set_path(healthy_gpu(0), "remapped_rows.pending", True)
    fail = set_path(healthy_gpu(1), "ecc.volatile_uncorrected", 3)
    assert evaluate(report([warn, healthy_gpu(2)])).verdict == WARN
    assert evaluate(report([warn, fail])).verdict == FAIL


def test_worst_orders_ok_unknown_warn_fail() -> None:
    assert worst([]) == OK
    assert worst([OK, UNKNOWN]) == UNKNOWN
    assert worst([UNKNOWN, WARN, OK]) == WARN
    assert worst([WARN, FAIL, UNKNOWN]) == FAIL


def test_a_gpu_with_several_problems_lists_every_reason() -> None:
    gpu = set_path(healthy_gpu(), "remapped_rows.pending", True)
    gpu = set_path(gpu, "ecc.volatile_uncorrected", 2)
    verdict = evaluate_gpu(gpu, Thresholds(), [xid(48), xid(63)])
    assert codes(verdict) == ["ecc.uncorrected", "remap.pending", "xid.48", "xid.63"]
    assert verdict.verdict == FAIL


def test_partial_nvml_errors_are_logged_not_failed() -> None:
    gpu = dict(healthy_gpu(), errors=["temperature: Insufficient Permissions"])
    verdict = evaluate_gpu(gpu, Thresholds())
    assert verdict.verdict == OK
    assert codes(verdict) == ["nvml.errors"]


# --- thresholds a category overrides ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "path", "value", "code"),
    [
        ({"ecc_corrected_warn": 100}, "ecc.volatile_corrected", 101, "ecc.corrected"),
        ({"temperature_margin_c": 5}, "temperature_c", 84, "temperature.slowdown"),
        ({"pcie_replay_warn": 100}, "pcie.replay_counter", 101, "pcie.replays"),
        ({"nvlink_error_warn": 10}, "nvlinks.5.crc_flit", 11, "nvlink.errors"),
        (
            {"retired_pages_max": 2},
            "retired_pages",
            {"single_bit": 2, "double_bit": 0, "pending": False},
            "retired_pages.limit",
        ),
        ({"clock_events_warn": ["sw_power_cap"]}, "clock_events", ["sw_power_cap"], "clocks.slowdown"),
    ],
)
def test_category_overrides_change_thresholds(
    overrides: dict[str, Any], path: str, value: Any, code: str
) -> None:
    gpu = set_path(healthy_gpu(), path, value)
    assert code not in codes(evaluate_gpu(gpu, Thresholds()))
    assert code in codes(evaluate_gpu(gpu, Thresholds().merged(overrides)))


@pytest.mark.parametrize(
    ("overrides", "path", "value"),
    [
        ({"pcie_check_generation": False}, "pcie.gen_current", 1),
        ({"nvlink_inactive_warn": False}, "nvlinks.0.active", False),
        ({"ecc_uncorrected_max": 5}, "ecc.volatile_uncorrected", 5),
    ],
)
def test_category_overrides_can_silence_a_rule(overrides: dict[str, Any], path: str, value: Any) -> None:
    gpu = set_path(healthy_gpu(), path, value)
    assert evaluate_gpu(gpu, Thresholds()).verdict != OK
    assert evaluate_gpu(gpu, Thresholds().merged(overrides)).verdict == OK


def test_temperature_warn_applies_only_without_a_slowdown_threshold() -> None:
    t = Thresholds().merged({"temperature_warn_c": 80})
    hot = set_path(healthy_gpu(), "temperature_c", 82)
    assert codes(evaluate_gpu(hot, t)) == []  # the GPU's own slowdown threshold (89 C) rules
    assert codes(evaluate_gpu(set_path(hot, "temperature_slowdown_c", None), t)) == ["temperature.limit"]


def test_xid_overrides_from_json_shaped_category_settings() -> None:
    settings = json.loads(
        '{"xid_overrides": {"63": {"severity": "FAIL", "action": "reset_gpu"}, "13": ["WARN", "restart_app"]}}'
    )
    t = Thresholds().merged(settings)
    node = evaluate(report(xid_events=[xid(63), xid(13, gpu_index=1), xid(79, gpu_index=1)]), t)
    assert [(r.code, r.severity) for r in node.gpus[0].reasons] == [("xid.63", FAIL)]
    assert [(r.code, r.severity) for r in node.gpus[1].reasons] == [("xid.13", WARN), ("xid.79", FAIL)]
    # A later merge keeps earlier overrides it does not mention.
    t2 = t.merged({"xid_overrides": {"94": {"severity": "OK", "action": "none"}}})
    assert set(t2.xid_overrides) == {63, 13, 94}
    assert Thresholds().xid_overrides == {}


@pytest.mark.parametrize(
    "overrides",
    [
        {"no_such_threshold": 1},
        {"xid_overrides": {"63": {"severity": "BAD", "action": "reset_gpu"}}},
        {"xid_overrides": {"63": {"severity": "WARN"}}},
        {"xid_overrides": {"abc": ["WARN", "none"]}},
    ],
)
def test_bad_overrides_are_invalid_input(overrides: dict[str, Any]) -> None:
    with pytest.raises(InvalidInput):
        Thresholds().merged(overrides)


def test_merging_nothing_returns_the_same_thresholds() -> None:
    t = Thresholds()
    assert t.merged(None) is t
    assert t.merged({}) is t


# --- staleness -----------------------------------------------------------------------------------

T0 = dt.datetime(2024, 11, 14, 7, 0, 0, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("age_s", "n", "code"),
    [
        (0, 3, None),
        (89.9, 3, None),
        (90, 3, "report.stale"),
        (3600, 3, "report.stale"),
        (59, 2, None),
        (60, 2, "report.stale"),
    ],
)
def test_no_report_for_n_intervals_is_unknown(age_s: float, n: int, code: str | None) -> None:
    finding = staleness(T0, T0 + dt.timedelta(seconds=age_s), 30.0, n)
    if code is None:
        assert finding is None
    else:
        assert finding is not None
        assert (finding.code, finding.severity, finding.action) == (code, UNKNOWN, Action.CHECK_AGENT)


def test_never_reported_is_unknown() -> None:
    finding = staleness(None, T0, 30.0)
    assert finding is not None and finding.severity == UNKNOWN and finding.code == "report.missing"


def test_verdicts_serialise_to_json() -> None:
    node = evaluate(report(xid_events=[xid(79), xid(999, gpu_index=None)]))
    data = json.loads(json.dumps(node.to_dict()))
    assert data["verdict"] == "FAIL"
    assert data["gpus"][0]["reasons"][0] == {
        "code": "xid.79",
        "severity": "FAIL",
        "message": data["gpus"][0]["reasons"][0]["message"],
        "action": "reboot_node",
    }
    assert data["findings"][0]["code"] == "xid.999"


def test_every_tabled_xid_has_a_meaning() -> None:
    assert all(rule.meaning for rule in XID_RULES.values())
    assert {13, 31, 43, 45, 68} <= {n for n, r in XID_RULES.items() if r.severity == OK}
