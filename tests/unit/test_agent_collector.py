"""The agent's collector against the one fake NVML fed by recorded values (bcm/lab/recorded_nvml/README.md)."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

from bcm.agent import schema
from bcm.agent.collector import (
    KmsgReader,
    XidWatcher,
    collect,
    normalize_bus_id,
    parse_xid_line,
    recovery_action_from_message,
)
from bcm.agent.fake_nvml import FakeNvml
from bcm.agent.main import main as agent_main
from bcm.agent.nvml import ERROR_LIBRARY_NOT_FOUND, NvmlError, RealNvml
from bcm.domain.health import Action, Verdict, evaluate
from bcm.lab.fakegpu import RECORDED_NVML
from tests.paths import set_path

DATA = RECORDED_NVML
MiB = 1_048_576


def fixture(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


def started(data: dict[str, Any]) -> FakeNvml:
    nv = FakeNvml(data)
    nv.init()
    return nv


def no_sleep(seconds: float) -> None:
    pass


def test_h100_values_arrive_in_report_units() -> None:
    report = collect(started(fixture("h100_sxm_565.json")), 3, hostname="gpu01", now=1_731_567_614.0)
    assert report["schema"] == 1
    assert (report["driver_version"], report["cuda_driver_version"]) == ("565.57.01", "12.7")
    assert (report["gpu_count"], report["expected_gpu_count"], report["errors"]) == (3, 3, [])
    assert report["collected_at"] == "2024-11-14T07:00:14.000Z"
    gpu = report["gpus"][0]
    assert gpu["uuid"] == "GPU-b42dd28e-ffdd-8720-1df0-98bd8cdc05b1"
    assert gpu["pci_bus_id"] == "0000:18:00.0"
    assert (gpu["temperature_c"], gpu["temperature_slowdown_c"], gpu["temperature_shutdown_c"]) == (
        30,
        89,
        95,
    )
    assert (gpu["power_draw_w"], gpu["power_limit_w"]) == (100.89, 700.0)
    assert (gpu["memory_total_mib"], gpu["memory_used_mib"]) == (81559, 1)
    assert gpu["ecc_enabled"] is True
    assert gpu["ecc"] == dict.fromkeys(
        ("volatile_corrected", "volatile_uncorrected", "aggregate_corrected", "aggregate_uncorrected"), 0
    )
    assert gpu["remapped_rows"] == {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False}
    assert gpu["retired_pages"] is None  # N/A on Hopper
    assert gpu["clock_events"] == ["gpu_idle"]
    assert len(gpu["nvlinks"]) == 18 and all(link["active"] for link in gpu["nvlinks"])
    assert gpu["pcie"] == {
        "replay_counter": 7,
        "gen_current": 5,
        "gen_max": 5,
        "width_current": 16,
        "width_max": 16,
    }
    assert gpu["recovery_action"] == "none"
    assert gpu["unsupported"] == [
        "retired_pages.single_bit",
        "retired_pages.double_bit",
        "retired_pages.pending",
    ]
    assert evaluate(report).verdict == Verdict.OK


@pytest.mark.parametrize(
    ("name", "unsupported", "checks"),
    [
        (
            "a100_sxm4_555.json",
            {
                "retired_pages.single_bit",
                "retired_pages.double_bit",
                "retired_pages.pending",
                "nvlink",
                "recovery_action",
            },
            {"nvlinks": [], "recovery_action": None, "retired_pages": None, "pci_bus_id": "0000:68:00.0"},
        ),
        (
            "v100_pcie_470.json",
            {"remapped_rows", "nvlink", "recovery_action"},
            {"remapped_rows": None, "retired_pages": {"single_bit": 1, "double_bit": 0, "pending": False}},
        ),
        (
            "a100_sxm4_remap_pending.json",
            {
                "serial",
                "vbios_version",
                "retired_pages.single_bit",
                "retired_pages.double_bit",
                "retired_pages.pending",
                "nvlink",
                "recovery_action",
            },
            {"serial": None, "vbios_version": None, "pci_bus_id": "0000:10:1c.0"},
        ),
    ],
)
def test_not_supported_metrics_become_none_and_are_listed(
    name: str, unsupported: set[str], checks: dict[str, Any]
) -> None:
    report = collect(started(fixture(name)), 1)
    gpu: dict[str, Any] = dict(report["gpus"][0])
    assert set(gpu["unsupported"]) == unsupported
    assert gpu["errors"] == [] and gpu["lost"] is False
    for key, value in checks.items():
        assert gpu[key] == value, key


def test_recorded_fixtures_without_faults_are_healthy() -> None:
    for name in ("h100_sxm_565.json", "a100_sxm4_555.json", "v100_pcie_470.json"):
        nv = started(fixture(name))
        assert evaluate(collect(nv, nv.device_count())).verdict == Verdict.OK, name


def test_recorded_remap_pending_after_xid_63_warns() -> None:
    nv = started(fixture("a100_sxm4_remap_pending.json"))
    watcher = XidWatcher(nv, use_kmsg=False, sleep=no_sleep)
    watcher.start()
    report = collect(nv, 1, xid_events=watcher.wait(0))
    assert [(e["xid"], e["gpu_index"], e["source"]) for e in report["xid_events"]] == [(63, 0, "nvml")]
    assert report["xid_events"][0]["uuid"] == "GPU-2b416d09-4537-ecc1-54fd-c6c83a764be9"
    gpu = evaluate(report).gpus[0]
    assert gpu.verdict == Verdict.WARN
    assert [r.code for r in gpu.reasons] == ["remap.pending", "xid.63"]


# One field of the recorded H100 fixture changed (NVML's raw form) → the finding the rules must give.
FAULTS = [
    ("gpus.1.ecc_errors.volatile.uncorrected", 2, "ecc.uncorrected", Verdict.FAIL),
    ("gpus.1.remapped_rows", [0, 1, 0, 1], "remap.failure", Verdict.FAIL),
    ("gpus.1.remapped_rows", [0, 1, 1, 0], "remap.pending", Verdict.WARN),
    ("gpus.1.temperature", 89, "temperature.slowdown", Verdict.WARN),
    ("gpus.1.temperature", 95, "temperature.shutdown", Verdict.FAIL),
    ("gpus.1.pcie.gen_current", 3, "pcie.generation", Verdict.WARN),
    ("gpus.1.pcie.width_current", 8, "pcie.width", Verdict.WARN),
    ("gpus.1.clock_event_reasons", 0x41, "clocks.slowdown", Verdict.WARN),
    ("gpus.1.nvlinks.7.active", False, "nvlink.inactive", Verdict.WARN),
    ("gpus.1.recovery_action", 2, "recovery_action", Verdict.FAIL),
    ("gpus.1.recovery_action", 3, "recovery_action", Verdict.WARN),
    ("gpus.1.temperature", "GPU_IS_LOST", "gpu.lost", Verdict.FAIL),
]


@pytest.mark.parametrize(("path", "value", "code", "severity"), FAULTS)
def test_fault_in_a_recorded_fixture_reaches_its_rule(
    path: str, value: Any, code: str, severity: Verdict
) -> None:
    report = collect(started(set_path(fixture("h100_sxm_565.json"), path, value)), 3)
    node = evaluate(report)
    gpu0, gpu1, gpu2 = node.gpus
    assert gpu0.verdict == gpu2.verdict == Verdict.OK
    assert [r.code for r in gpu1.reasons] == [code]
    assert gpu1.verdict == node.verdict == severity


def test_a_lost_gpu_stops_being_queried_and_says_why() -> None:
    report = collect(started(set_path(fixture("h100_sxm_565.json"), "gpus.1.temperature", "GPU_IS_LOST")), 3)
    gpu = report["gpus"][1]
    assert gpu["lost"] is True
    assert gpu["errors"] == ["temperature: GPU_IS_LOST"]
    assert gpu["uuid"] == "GPU-7c3cadbd-17e5-0913-f69b-c618122ea0cd"  # read before the loss
    assert gpu["power_draw_w"] is None and gpu["nvlinks"] == []


def test_other_nvml_errors_are_recorded_without_failing_the_gpu() -> None:
    report = collect(
        started(set_path(fixture("h100_sxm_565.json"), "gpus.0.power_usage_mw", "NO_PERMISSION")), 3
    )
    gpu = report["gpus"][0]
    assert gpu["errors"] == ["power_draw: NO_PERMISSION"]
    assert gpu["lost"] is False and gpu["temperature_c"] == 30
    assert evaluate(report).gpus[0].verdict == Verdict.OK


def test_fewer_gpus_than_expected_fails_the_node() -> None:
    data = fixture("h100_sxm_565.json")
    del data["gpus"][2]  # as if GPU 00000000:3A:00.0 had fallen off the bus
    report = collect(started(data), 3)
    node = evaluate(report)
    assert report["gpu_count"] == 2
    assert [(f.code, f.severity, f.action) for f in node.findings] == [
        ("gpu.count", Verdict.FAIL, Action.REBOOT_NODE)
    ]


def test_nvml_that_cannot_start_raises_a_clear_error() -> None:
    nv = FakeNvml(dict(fixture("h100_sxm_565.json"), init_error="LIBRARY_NOT_FOUND"))
    with pytest.raises(NvmlError) as caught:
        nv.init()
    assert caught.value.code == ERROR_LIBRARY_NOT_FOUND
    with pytest.raises(NvmlError):
        nv.device_count()


def test_device_count_failure_is_reported_not_raised() -> None:
    nv = started(set_path(fixture("h100_sxm_565.json"), "gpus", "DRIVER_NOT_LOADED"))
    report = collect(nv, 3)
    assert report["gpu_count"] == 0 and report["gpus"] == []
    assert report["errors"] == ["device_count: DRIVER_NOT_LOADED"]
    assert evaluate(report).verdict == Verdict.FAIL


def test_real_nvml_on_this_machine_reports_why_it_cannot_start() -> None:
    try:
        nv = RealNvml()
        nv.init()
    except NvmlError as exc:
        assert exc.name in {"LIBRARY_NOT_FOUND", "DRIVER_NOT_LOADED", "NO_PERMISSION", "UNKNOWN"}
        assert str(exc)
        return
    nv.shutdown()
    pytest.skip("this machine has a working NVML; scripts/gpu-check exercises it")


def test_real_nvml_maps_a_missing_pynvml_function_to_function_not_found() -> None:
    nv = RealNvml()
    with pytest.raises(NvmlError) as caught:
        nv._call("nvmlNoSuchFunction")
    assert caught.value.name == "FUNCTION_NOT_FOUND" and caught.value.unavailable


# --- Xid events -------------------------------------------------------------------------------------


def test_xid_event_from_nvml_is_attributed_to_its_gpu() -> None:
    nv = started(fixture("h100_sxm_565.json"))
    watcher = XidWatcher(nv, use_kmsg=None, sleep=no_sleep)
    watcher.start()
    assert watcher.nvml_events and not watcher.kmsg_open
    assert watcher.wait(5.0) == []  # nothing queued: the fake returns at once
    nv.push_xid(79, 2)
    events = watcher.wait(5.0)
    report = collect(nv, 3, xid_events=events, now=0.0)
    (event,) = report["xid_events"]
    assert event["xid"] == 79 and event["source"] == "nvml"
    assert (event["gpu_index"], event["uuid"], event["pci_bus_id"]) == (
        2,
        "GPU-2d50cdf6-dd67-9f2e-855e-0d4d6d395a2f",
        "0000:3a:00.0",
    )
    node = evaluate(report)
    assert node.gpus[2].verdict == Verdict.FAIL
    assert node.gpus[2].reasons[0].action == Action.REBOOT_NODE


def test_xid_154_from_nvml_takes_the_recovery_action_from_the_field() -> None:
    nv = started(set_path(fixture("h100_sxm_565.json"), "gpus.0.recovery_action", 1))
    watcher = XidWatcher(nv, use_kmsg=False, sleep=no_sleep)
    watcher.start()
    nv.push_xid(154, 0)  # NVML's event carries only the number; the action comes from the GPU's field
    report = collect(nv, 3, xid_events=watcher.wait(0))
    assert report["xid_events"][0]["recovery_action"] == "gpu_reset"
    gpu = evaluate(report).gpus[0]
    assert [(r.code, r.action) for r in gpu.reasons] == [
        ("recovery_action", Action.RESET_GPU),
        ("xid.154", Action.RESET_GPU),
    ]


def test_failing_nvml_event_wait_falls_back_to_the_kernel_log_and_still_waits() -> None:
    nv = started(dict(fixture("a100_sxm4_remap_pending.json"), event_wait="GPU_IS_LOST", xid_events=[]))
    slept: list[float] = []
    reader = KmsgReader(str(DATA / "kmsg_xid.txt"))
    watcher = XidWatcher(nv, kmsg=reader, sleep=slept.append)
    watcher.start()
    assert watcher.nvml_events and not watcher.kmsg_open
    events = watcher.wait(1.0)
    watcher.stop()
    assert slept == [1.0]  # no busy loop when the event set is broken
    assert not watcher.nvml_events
    assert "NVML Xid wait failed (GPU_IS_LOST)" in watcher.problems[-1]
    assert [e["xid"] for e in events] == [63, 119, 154, 79, 154]


def test_nvlink_links_without_support_are_skipped_and_later_links_kept() -> None:
    data = fixture("h100_sxm_565.json")
    data["gpus"][0]["nvlinks"][2] = "NOT_SUPPORTED"
    data["gpus"][0]["nvlinks"][5]["errors"][1] = "NOT_SUPPORTED"
    gpu = collect(started(data), 3)["gpus"][0]
    assert [link["link"] for link in gpu["nvlinks"]] == [n for n in range(18) if n != 2]
    assert gpu["nvlinks"][4]["link"] == 5 and gpu["nvlinks"][4]["recovery"] is None
    assert gpu["unsupported"][-1] == "nvlink.counters"


def test_a_burst_of_xids_is_drained_in_one_wait() -> None:
    nv = started(fixture("h100_sxm_565.json"))
    watcher = XidWatcher(nv, use_kmsg=False, sleep=no_sleep)
    watcher.start()
    for gpu in (0, 1, 2):
        nv.push_xid(74, gpu)
    assert [e["gpu_index"] for e in watcher.wait(1.0)] == [0, 1, 2]


def test_too_many_xids_keep_the_newest_and_say_so() -> None:
    nv = started(fixture("h100_sxm_565.json"))
    events = [
        parse_xid_line(f"NVRM: Xid (PCI:0000:18:00): 13, pid={n}", time_iso="2024-11-14T07:00:00.000Z")
        for n in range(schema.MAX_XID_EVENTS + 5)
    ]
    report = collect(nv, 3, xid_events=[e for e in events if e])
    assert len(report["xid_events"]) == schema.MAX_XID_EVENTS
    assert report["xid_events"][-1]["message"] == f"pid={schema.MAX_XID_EVENTS + 4}"
    assert report["errors"] == [
        f"{schema.MAX_XID_EVENTS + 5} Xid events; reporting the last {schema.MAX_XID_EVENTS}"
    ]


def test_kernel_log_is_the_fallback_when_nvml_events_are_unsupported() -> None:
    nv = started(
        dict(fixture("a100_sxm4_remap_pending.json"), event_registration="NOT_SUPPORTED", xid_events=[])
    )
    reader = KmsgReader(str(DATA / "kmsg_xid.txt"), wall_clock=lambda: 20_000.0, monotonic=lambda: 14_000.0)
    watcher = XidWatcher(nv, kmsg=reader, sleep=no_sleep)
    watcher.start()
    assert not watcher.nvml_events and watcher.kmsg_open
    assert "NVML Xid events unavailable" in watcher.problems[0]
    events = watcher.wait(1.0)
    watcher.stop()
    assert [(e["xid"], e["pci_bus_id"], e["recovery_action"]) for e in events] == [
        (63, "0000:10:1c.0", None),
        (119, "0000:97:00.0", None),
        (154, "0000:97:00.0", "gpu_reset"),
        (79, "0000:44:00.0", None),
        (154, "0000:01:00.0", "node_reboot"),
    ]
    # kmsg stamps are microseconds since boot: 9813.402001 s after boot, boot at 20000 - 14000 s.
    assert events[0]["time"] == "1970-01-01T04:23:33.402Z"
    report = collect(nv, 1, xid_events=events)
    node = evaluate(report)
    # The Xid 63 line names this GPU's bus (0000:10:1c); the others name GPUs this node does not have.
    assert [r.code for r in node.gpus[0].reasons] == ["remap.pending", "xid.63"]
    assert report["xid_events"][0]["uuid"] == "GPU-2b416d09-4537-ecc1-54fd-c6c83a764be9"
    assert [f.code for f in node.findings] == ["xid.119", "xid.154", "xid.79", "xid.154"]
    assert node.verdict == Verdict.FAIL


def test_unreadable_kernel_log_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    nv = started(dict(fixture("h100_sxm_565.json"), event_registration="NOT_SUPPORTED"))
    slept: list[float] = []
    watcher = XidWatcher(nv, kmsg=KmsgReader(str(tmp_path / "absent")), sleep=slept.append)
    watcher.start()
    assert not watcher.kmsg_open and "unreadable" in watcher.problems[-1]
    assert watcher.wait(0.5) == [] and slept == [0.5]


def test_kmsg_reader_follows_new_records_and_joins_split_lines(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("4,1,100,-;NVRM: Xid (PCI:0000:18:00): 48, pid=1, old event\n")
    reader = KmsgReader(str(log), from_start=False, wall_clock=lambda: 1000.0, monotonic=lambda: 10.0)
    reader.open()
    try:
        assert reader.poll() == []  # from_start=False skips what was there
        with log.open("a") as f:
            f.write("4,2,5000000,-;NVRM: Xid (PCI:0000:18:00): 9")
        assert reader.poll() == []  # half a record
        with log.open("a") as f:
            f.write("5, pid=7, DBE\n 4,3,0,-;continuation lines are skipped\n")
        (event,) = reader.poll()
    finally:
        reader.close()
    assert (event["xid"], event["message"], event["pci_bus_id"]) == (95, "pid=7, DBE", "0000:18:00.0")
    assert event["time"] == "1970-01-01T00:16:35.000Z"  # 1000 - (10 - 5) s


@pytest.mark.parametrize(
    ("line", "xid", "bus", "action"),
    [
        (ln, *exp)
        for ln, exp in zip(
            (DATA / "dmesg_xid.txt").read_text().splitlines()[1:],
            [
                (119, "0000:97:00.0", None),
                (154, "0000:97:00.0", "gpu_reset"),
                (154, "0000:01:00.0", "node_reboot"),
                (63, "0000:10:1c.0", None),
                (79, "0000:44:00.0", None),
            ],
            strict=True,
        )
    ],
)
def test_parse_recorded_dmesg_lines(line: str, xid: int, bus: str, action: str | None) -> None:
    event = parse_xid_line(line, time_iso="2024-11-14T07:00:00.000Z")
    assert event is not None
    assert (event["xid"], event["pci_bus_id"], event["recovery_action"], event["source"]) == (
        xid,
        bus,
        action,
        "kmsg",
    )


def test_lines_that_are_not_xids_are_ignored() -> None:
    first = (DATA / "dmesg_xid.txt").read_text().splitlines()[0]
    for line in (first, "NVRM: loading NVIDIA UNIX Open Kernel Module", "", "Xid 79 mentioned in prose"):
        assert parse_xid_line(line, time_iso="t") is None


@pytest.mark.parametrize(
    ("message", "action"),
    [
        ("GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)", "drain_and_reset"),
        ("GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)", "none"),
        ("GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)", "drain_p2p"),
        ("GPU recovery action changed from 0x0 (None) to 0x2 (OS Reboot)", "node_reboot"),
        ("GPU recovery action changed from 0x0 (None) to 0x9 (Future)", "unknown_9"),
        ("some other text", None),
    ],
)
def test_recovery_action_from_message(message: str, action: str | None) -> None:
    assert recovery_action_from_message(message) == action


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("00000000:18:00.0", "0000:18:00.0"),
        ("0000:3A:00", "0000:3a:00.0"),
        ("18:00.1", "0000:18:00.1"),
        ("00000001:C2:00.0", "0001:c2:00.0"),
        ("not a bus", None),
    ],
)
def test_normalize_bus_id(raw: str, normal: str | None) -> None:
    assert normalize_bus_id(raw) == normal


# --- the bcm-agent command --------------------------------------------------------------------------


def test_agent_once_prints_a_report_from_a_fixture() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = agent_main(["--once", "--fake", str(DATA / "v100_pcie_470.json"), "--expected-gpus", "1"])
    assert rc == 0
    report = json.loads(out.getvalue())
    assert report["gpus"][0]["name"] == "Tesla V100-PCIE-32GB"
    assert report["expected_gpu_count"] == 1


def test_agent_once_exits_3_when_nvml_cannot_start(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(dict(fixture("h100_sxm_565.json"), init_error="DRIVER_NOT_LOADED")))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert agent_main(["--once", "--fake", str(broken)]) == 3
    assert "DRIVER_NOT_LOADED" in err.getvalue()


def test_agent_refuses_a_config_others_can_read(tmp_path: Path) -> None:
    config = tmp_path / "agent.json"
    config.write_text(json.dumps({"server_url": "http://127.0.0.1:1", "token": "t"}))
    os.chmod(config, 0o644)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = agent_main(["--config", str(config), "--fake", str(DATA / "h100_sxm_565.json")])
    assert rc == 2
    assert "chmod 600" in err.getvalue()


def test_a_fake_from_a_file_blocks_like_nvml_when_the_agent_runs_on_it(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`bcm-agent --fake FILE` must not spin: with nothing queued, wait_xid sleeps out its timeout."""
    import json as _json

    from bcm.agent import fake_nvml
    from bcm.agent.main import open_backend

    path = tmp_path / "fixture.json"
    path.write_text(_json.dumps({"gpus": [], "xid_events": [{"xid": 79, "gpu_index": 0}]}))
    slept: list[float] = []
    monkeypatch.setattr(fake_nvml.time, "sleep", slept.append)
    backend = open_backend(str(path))
    backend.init()
    backend.register_xid_events()
    assert backend.wait_xid(2000) is not None and slept == []  # a queued event comes at once
    assert backend.wait_xid(2000) is None and slept == [2.0]
    plain = fake_nvml.FakeNvml.from_file(path)
    plain.init()
    plain.register_xid_events()
    plain.wait_xid(0)
    assert plain.wait_xid(2000) is None and slept == [2.0]  # unit tests' fake never sleeps


def test_nvml_strings_lose_control_characters_so_the_server_takes_the_report() -> None:
    from bcm.agent.collector import _s

    assert _s("NVIDIA H100\x00\x1b[31m\x9b") == "NVIDIA H100[31m"
    assert _s(None) is None
