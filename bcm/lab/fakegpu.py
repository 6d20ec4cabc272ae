"""Simulated NVIDIA GPUs for lab nodes: an ``nvidia-smi`` that prints recorded H100 output with per-node
UUIDs, character devices ``nvidia<N>`` (major 195, as the driver makes them) for Slurm's gres.conf, and
recorded NVML values (``nvml.json``) that the bcm agent on the node replays instead of a real NVML.

There is no GPU here; inventory, Slurm's GRES scheduling and ``CUDA_VISIBLE_DEVICES`` only need
the first two. The devices go under ``DEVICE_DIR`` inside the node's own root, not ``/dev``: lab
nodes bind the host's ``/dev``, so device nodes made there would appear on the host and on every node.
``inject_xid`` and ``recover`` rewrite ``nvml.json`` while the agent runs (see
:class:`bcm.agent.fake_nvml.SimulatedNvml`), so a user can watch bcm drain and resume a node.
"""

from __future__ import annotations

import copy
import json
import os
import stat
import uuid
import zlib
from pathlib import Path
from typing import Any

from bcm.agent.fake_nvml import SIMULATED_NVML_PATH
from bcm.lab.errors import LabError
from bcm.lab.node import LabNode

DEVICE_DIR = "/var/lib/bcm-fakegpu"
RECORDED_NVML = Path(__file__).resolve().parent / "recorded_nvml"  # provenance in its README.md
RECORDING = "h100_sxm_565.json"
NVIDIA_MAJOR = 195
H100_NAME = "NVIDIA H100 80GB HBM3"
# PCI bus ids of an HGX H100 board (tests/data/facts/lspci-nnmm-hgx-h100.txt)
_BUS_IDS = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")
_DRIVER, _VBIOS, _MEMORY_MIB = "550.54.15", "96.00.89.00.01", 81559

_SCRIPT = """#!/bin/sh
# Fake nvidia-smi written by bcm.lab.fakegpu for node {node}: recorded H100 output, no GPU behind it.
case " $* " in
  *" --query-gpu="*)
    cat <<'CSV'
{csv}CSV
    ;;
  *" -L "*)
    cat <<'LIST'
{listing}LIST
    ;;
  *)
    echo "NVIDIA-SMI {driver}    Driver Version: {driver}    (bcm lab fake: {count} GPUs)"
    ;;
esac
exit 0
"""


def gpu_uuid(node: str, index: int) -> str:
    """Stable, unique per node and index (GPU UUIDs are unique across a cluster)."""
    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{node}.gpu{index}.bcm-lab"))


def csv_rows(node: str, count: int) -> list[str]:
    """``index, uuid, name, memory.total, serial, pci.bus_id, driver_version, vbios_version`` rows."""
    rows = []
    for i in range(count):
        serial = 1652423011000 + (zlib.crc32(node.encode()) % 1000) * 10 + i
        bus = f"00000000:{_BUS_IDS[i % len(_BUS_IDS)]}:00.0"
        rows.append(
            f"{i}, {gpu_uuid(node, i)}, {H100_NAME}, {_MEMORY_MIB}, {serial}, {bus}, {_DRIVER}, {_VBIOS}"
        )
    return rows


MAX_GPUS = len(_BUS_IDS)


def _root(node: LabNode) -> Path:
    root = node.root_view
    if root is None:
        raise LabError(f"lab node {node.name} is not running")
    return root


def nvml_values(node: str, count: int) -> dict[str, Any]:
    """The recorded H100 NVML values, one GPU per simulated device, with this node's UUIDs and bus ids."""
    data: dict[str, Any] = json.loads((RECORDED_NVML / RECORDING).read_text())
    recorded = data["gpus"]
    gpus = []
    for i in range(count):
        gpu = copy.deepcopy(recorded[i % len(recorded)])
        gpu["uuid"] = gpu_uuid(node, i)
        gpu["pci_bus_id"] = f"00000000:{_BUS_IDS[i % len(_BUS_IDS)]}:00.0"
        gpus.append(gpu)
    data["gpus"] = gpus
    data["xid_events"] = []
    return data


def _nvml_file(node: LabNode) -> Path:
    return _root(node) / SIMULATED_NVML_PATH.lstrip("/")


def _write_nvml(path: Path, data: dict[str, Any]) -> None:
    # a new file renamed into place: the agent reading it sees the old or the new values, never half
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def _read_nvml(node: LabNode) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(_nvml_file(node).read_text())
    except FileNotFoundError:
        raise LabError(f"lab node {node.name} has no simulated GPUs (bcm lab up --gpus N)") from None
    return data


def inject_xid(node: LabNode, xid: int, gpu: int = 0) -> int:
    """Queue an Xid on a simulated GPU; Xid 79 (fallen off the bus) also leaves it lost until recover()."""
    data = _read_nvml(node)
    if not 0 <= gpu < len(data["gpus"]):
        raise LabError(f"{node.name} has GPUs 0 to {len(data['gpus']) - 1}, not {gpu}")
    seq = int(data.get("xid_seq", 0)) + 1
    data["xid_seq"] = seq
    data["xid_events"] = [*data.get("xid_events", []), {"seq": seq, "gpu_index": gpu, "xid": xid}]
    if xid == 79:
        data["gpus"][gpu]["temperature"] = "GPU_IS_LOST"
    _write_nvml(_nvml_file(node), data)
    return seq


def recover(node: LabNode) -> None:
    """Back to the recorded healthy values (no GPU lost, no Xid pending); Xids already sent stay sent."""
    data = _read_nvml(node)
    fresh = nvml_values(node.name, len(data["gpus"]))
    fresh["xid_seq"] = int(data.get("xid_seq", 0))
    _write_nvml(_nvml_file(node), fresh)


def install(node: LabNode, count: int = 2) -> list[str]:
    """Give a running lab node ``count`` simulated H100s; returns their UUIDs."""
    root = _root(node)
    if not 1 <= count <= MAX_GPUS:
        raise LabError(f"a fake node has 1 to {MAX_GPUS} GPUs, not {count}")
    rows = csv_rows(node.name, count)
    listing = "".join(f"GPU {i}: {H100_NAME} (UUID: {gpu_uuid(node.name, i)})\n" for i in range(count))
    script = root / "usr/local/bin/nvidia-smi"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(
        _SCRIPT.format(
            node=node.name, csv="".join(r + "\n" for r in rows), listing=listing, driver=_DRIVER, count=count
        )
    )
    script.chmod(0o755)
    devices = root / DEVICE_DIR.lstrip("/")
    devices.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        path = devices / f"nvidia{i}"
        if path.exists() and not stat.S_ISCHR(path.stat().st_mode):
            path.unlink()
        if not path.exists():
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, i))
    nvml = _nvml_file(node)
    nvml.parent.mkdir(parents=True, exist_ok=True)
    _write_nvml(nvml, nvml_values(node.name, count))
    return [gpu_uuid(node.name, i) for i in range(count)]


def device_paths(count: int) -> list[Path]:
    return [Path(DEVICE_DIR) / f"nvidia{i}" for i in range(count)]
