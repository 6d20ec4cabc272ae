"""Fake NVIDIA GPUs for lab nodes: an ``nvidia-smi`` that prints recorded H100 output with per-node UUIDs,
and character devices ``nvidia<N>`` (major 195, as the driver makes them) for Slurm's gres.conf.

There is no GPU here; inventory, Slurm's GRES scheduling and ``CUDA_VISIBLE_DEVICES`` only need
these two things. The devices go under ``DEVICE_DIR`` inside the node's own root, not ``/dev``: lab
nodes bind the host's ``/dev``, so device nodes made there would appear on the host and on every node.
"""

from __future__ import annotations

import os
import stat
import uuid
import zlib
from pathlib import Path

from bcm.lab.errors import LabError
from bcm.lab.node import LabNode

DEVICE_DIR = "/var/lib/bcm-fakegpu"
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


def install(node: LabNode, count: int = 2) -> list[str]:
    """Give a running lab node ``count`` fake H100s; returns their UUIDs."""
    root = node.root_view
    if root is None:
        raise LabError(f"lab node {node.name} is not running")
    if not 1 <= count <= len(_BUS_IDS):
        raise LabError(f"a fake node has 1 to {len(_BUS_IDS)} GPUs, not {count}")
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
    return [gpu_uuid(node.name, i) for i in range(count)]


def device_paths(count: int) -> list[Path]:
    return [Path(DEVICE_DIR) / f"nvidia{i}" for i in range(count)]
