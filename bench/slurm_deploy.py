"""Benchmark: deploy Slurm with bcm onto SSH lab nodes (fake GPUs, slurmdbd on the host's MariaDB).

Prints the first deploy (Ansible from scratch + registration + verification job), a re-deploy that
changes nothing, and a verification job on its own. Needs root (network namespaces). Figures only;
nothing is asserted.
Usage: .venv/bin/python bench/slurm_deploy.py [--nodes 4] [--gpus 2]
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bcm.lab.slurm import SlurmLab


def seconds(op: dict[str, Any]) -> float:
    start = datetime.fromisoformat(op["created_at"])
    end = datetime.fromisoformat(op["finished_at"])
    return (end - start).total_seconds()


def ansible_seconds(op: dict[str, Any]) -> str:
    found = re.search(r"ansible: \S+ rc=\S+ changed=(\d+) in ([0-9.]+)s", op.get("log") or "")
    return f"{found.group(2)} s (changed={found.group(1)})" if found else "?"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=4, help="lab nodes in all: one controller + compute")
    parser.add_argument("--gpus", type=int, default=2, help="fake GPUs per compute node")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bcm-bench-slurm-"))
    try:
        figures = measure(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for line in figures:
        print(line)


def measure(work: Path, args: argparse.Namespace) -> list[str]:
    t0 = time.perf_counter()
    with SlurmLab.running(
        work, nodes=args.nodes, gpus_per_node=args.gpus, name="bcmbench", subnet="198.18.4.0/24"
    ) as run:
        setup = time.perf_counter() - t0
        first = run.deploy()
        second = run.deploy(verify=False)
        t1 = time.perf_counter()
        verify = run.wait(run.http.post("/api/v1/wlm/lab/verify").json()["operation_id"])
        verify_wall = time.perf_counter() - t1
        compute = len(run.compute)
    lines = [f"slurm deploy with bcm: 1 controller + {compute} compute nodes, {args.gpus} fake GPUs each"]
    lines.append(f"  lab up + register + inventory      {setup:7.1f} s")
    lines.append(
        f"  first deploy (incl. verify job)    {seconds(first):7.1f} s  state={first['state']}"
        f"  ansible {ansible_seconds(first)}"
    )
    lines.append(
        f"  re-deploy (no verify)              {seconds(second):7.1f} s  state={second['state']}"
        f"  ansible {ansible_seconds(second)}"
    )
    for label, op in (("first", first), ("re-deploy", second)):
        slow = re.search(r"slowest tasks: (.*)", op.get("log") or "")
        lines.append(f"  {label} slowest tasks: {slow.group(1) if slow else '?'}")
    lines.append(f"  verification job alone             {verify_wall:7.1f} s  state={verify['state']}")
    return lines


if __name__ == "__main__":
    main()
