"""Benchmark: deploy Kubernetes with bcm onto SSH lab nodes (the lab's control plane on one node, a kwok
kubelet on each GPU node, Kueue), beside a Slurm deploy of the same nodes in the same run; then the time
from an injected XID 79 to the node carrying bcm's taint in the API, beside the goal (2 x the agent's
report interval).

Prints figures only; nothing is asserted. Needs root and scripts/k8s-tools built.
Usage: .venv/bin/python bench/k8s_deploy.py [--nodes 8] [--interval 2] [--xids 3]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bcm.lab import fakegpu
from bcm.lab.slurm import SlurmLab

KUBECTL = ["/usr/local/lib/bcm-k8s/bin/kubectl", "--kubeconfig", "/etc/bcm-k8s/admin.kubeconfig"]


def seconds(op: dict[str, Any]) -> float:
    return (
        datetime.fromisoformat(op["finished_at"]) - datetime.fromisoformat(op["created_at"])
    ).total_seconds()


def ansible(op: dict[str, Any]) -> str:
    found = re.search(r"ansible: \S+ rc=\S+ changed=(\d+) in ([0-9.]+)s", op.get("log") or "")
    api = re.search(r"api: changed=(\d+)", op.get("log") or "")
    return (f"ansible {found.group(2)} s, changed={found.group(1)}" if found else "?") + (
        f", api changed={api.group(1)}" if api else ""
    )


def tainted(run: SlurmLab, node: str) -> bool:
    done = run.lab.run(run.controller, [*KUBECTL, "get", "node", node, "-o", "json"], timeout=30)
    taints = json.loads(done.stdout).get("spec", {}).get("taints") or [] if done.returncode == 0 else []
    return any(t["key"] == "bcm.io/gpu-unhealthy" for t in taints)


def wait(what: str, check: Any, timeout_s: float = 180) -> float:
    t0 = time.perf_counter()
    while not check():  # bounded by timeout_s
        if time.perf_counter() - t0 > timeout_s:
            raise SystemExit(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(0.1)
    return time.perf_counter() - t0


def measure(work: Path, args: argparse.Namespace) -> list[str]:
    with SlurmLab.running(
        work,
        nodes=args.nodes + 1,
        gpus_per_node=2,
        name="bcmbenchk8s",
        subnet="198.18.97.0/24",
        server_host="0.0.0.0",
    ) as run:
        base = [
            "wlm",
            "deploy",
            "kubernetes",
            "--name",
            "k8s",
            "--control-plane",
            run.controller,
            "--nodes",
            run.hostlist,
            "--json",
        ]
        first = json.loads(run.cli_raw(*base).stdout)
        again = json.loads(run.cli_raw(*base, "--no-verify").stdout)
        url = f"http://{run.lab.head_ip}:{run.server.port}"
        run.cli_raw("agent", "deploy", run.hostlist, "--server-url", url, "--interval", str(args.interval))
        sick = run.lab.node(run.compute[0])
        delays = []
        for _ in range(args.xids):
            wait("the agent to report OK", lambda: not tainted(run, sick.name))
            time.sleep(args.interval)
            t0 = time.perf_counter()
            fakegpu.inject_xid(sick, 79)
            wait("bcm's taint", lambda: tainted(run, sick.name))
            delays.append(time.perf_counter() - t0)
            fakegpu.recover(sick)
        run.cli_raw("wlm", "rm", "k8s")
        slurm = run.deploy()  # the same nodes, Slurm, in the same run: the peer
        slurm_again = run.deploy(verify=False)
    n = len(run.compute)
    return [
        f"kubernetes deploy with bcm: control plane + {n} kwok GPU nodes (2 GPUs each), Kueue, verify Job",
        f"  first deploy   {seconds(first):7.1f} s  ({first['state']}; {ansible(first)})",
        f"  re-deploy      {seconds(again):7.1f} s  ({again['state']}; {ansible(again)})",
        f"slurm deploy with bcm on the same {n} nodes (peer)",
        f"  first deploy   {seconds(slurm):7.1f} s  ({slurm['state']}; {ansible(slurm)})",
        f"  re-deploy      {seconds(slurm_again):7.1f} s  ({slurm_again['state']}; {ansible(slurm_again)})",
        f"XID 79 -> bcm's taint in the API, {len(delays)} times: median {statistics.median(delays):.2f} s,"
        f" max {max(delays):.2f} s; goal < {2 * args.interval:.1f} s (2 x the {args.interval:g} s report interval)",
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=8, help="GPU nodes (a control-plane node is added)")
    parser.add_argument("--interval", type=float, default=2.0, help="the agents' report interval, seconds")
    parser.add_argument("--xids", type=int, default=3, help="XID injections to time")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bcm-bench-k8s-"))
    try:
        figures = measure(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for line in figures:
        print(line)


if __name__ == "__main__":
    main()
