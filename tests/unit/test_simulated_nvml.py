"""The lab's simulated GPUs: recorded NVML values the agent replays, changed by `bcm lab inject` while it runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bcm.agent.collector import collect
from bcm.agent.fake_nvml import SimulatedNvml
from bcm.lab import fakegpu


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, s: float) -> None:
        self.now += s

    def mono(self) -> float:
        return self.now


def write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name("tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def test_values_are_the_recording_with_the_nodes_uuids(tmp_path: Path) -> None:
    path = tmp_path / "nvml.json"
    write(path, fakegpu.nvml_values("node02", 2))
    nv = SimulatedNvml(path)
    nv.init()
    report = collect(nv, 2, hostname="node02")
    assert [g["uuid"] for g in report["gpus"]] == [fakegpu.gpu_uuid("node02", i) for i in range(2)]
    assert report["gpus"][0]["name"] == fakegpu.H100_NAME and not report["errors"]


def test_injected_xids_arrive_once_and_a_lost_gpu_heals_on_recover(tmp_path: Path) -> None:
    path = tmp_path / "nvml.json"
    healthy = fakegpu.nvml_values("node03", 2)
    write(path, healthy)
    clock = Clock()
    nv = SimulatedNvml(path, sleep=clock.sleep, monotonic=clock.mono)
    nv.init()
    nv.register_xid_events()
    assert nv.wait_xid(2000) is None and clock.now >= 2.0  # waits out its timeout, no spinning

    sick = json.loads(path.read_text())
    sick["xid_seq"] = 1
    sick["xid_events"] = [{"seq": 1, "gpu_index": 1, "xid": 79}]
    sick["gpus"][1]["temperature"] = "GPU_IS_LOST"
    write(path, sick)
    event = nv.wait_xid(1000)
    assert event is not None and (event.xid, event.gpu_index) == (79, 1)
    assert nv.wait_xid(0) is None
    lost = collect(nv, 2, hostname="node03")
    assert lost["gpus"][1]["lost"] and not lost["gpus"][0]["lost"]

    write(path, {**healthy, "xid_seq": 1})  # recover: same seq, so the Xid is not sent again
    assert nv.wait_xid(0) is None
    assert not any(g["lost"] for g in collect(nv, 2, hostname="node03")["gpus"])


def test_no_file_means_no_gpus(tmp_path: Path) -> None:
    nv = SimulatedNvml(tmp_path / "absent.json")
    try:
        nv.init()
    except Exception as exc:  # NvmlError, as the real library without a driver
        assert "LIBRARY_NOT_FOUND" in str(exc) or "no simulated GPUs" in str(exc)
    else:
        raise AssertionError("init() succeeded without simulated GPUs")
