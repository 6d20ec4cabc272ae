"""Benchmark: power-on → ready per VM, zero-touch against the manual chain, on lab VMs, in one run (root).

One lab (its own name and subnet: ``ztbench``, 198.18.84.0/24), two namespace nodes (node01 controls the
manual chain's Slurm cluster, node02 the zero-touch one), ``--vms`` TCG qemu VMs behind IPMI/Redfish BMC
emulators sharing one BMC password, the ``lab`` image, and bcm's PXE on the lab's provisioning interface.

  manual: the README's PXE flow, then the agent and Slurm, each command run as soon as the one before
          returned (no admin thinking time: a lower bound on the manual chain):
          `bcm lab vm-power on --pxe` (discovery boot) → `bcm node discovered --wait N` → `bcm node assign`
          and `bcm lab vm-bmc` per VM → `bcm node provision --wait` → (the inventory bcm starts after the
          callback) → `bcm agent deploy` → `bcm wlm deploy slurm` → `ready`.
  zero-touch: the VMs' nodes removed and the VMs off; then the README's Zero-touch set-up (a category with a
          discovery rule, `--auto-provision`, `--wlm-cluster`, the BMC password for the BMC range) and only
          `bcm lab vm-power on --pxe`: discovered → registered → provisioned → booted → inventoried → joined
          → verified → `ready`, with no command.

Each node's states are read every 2 s; power-on is when `bcm lab vm-power on --pxe` was run. Prints each
VM's power-on → ready for both and the ratio (goal: zero-touch no slower than the manual chain; it runs no
command in between); asserts nothing. TCG VMs boot in minutes: a run takes 30-60 minutes, every command and
the whole run bounded in time. Lab addresses only inside 198.18.84.0/24, in network namespaces.
Usage: .venv/bin/python bench/zero_touch.py [--vms 3] [--timeout 7200]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bcm.devserver import BCM, REPO, Server
from bcm.lab import vm

LAB, SUBNET, HEAD = "ztbench", "198.18.84.0/24", "198.18.84.1"
DHCP_RANGE, BMC_RANGE = "198.18.84.100-198.18.84.150", "198.18.84.192/26"
PASSWORD = "ztbench-bmc-pw"  # noqa: S105 - the lab's emulated BMCs, gone with the lab
MANUAL, ZT, MANUAL_CLUSTER, ZT_CLUSTER = "ztm", "ztz", "ztbm", "ztbz"
BOOT_WAIT_S = 2400


class Bench:
    def __init__(self, server: Server, deadline: float) -> None:
        self.server, self.deadline = server, deadline
        self.lab_dir = server.state_dir / "lab" / LAB

    def cli(self, *args: str, timeout: float = 1800, stdin: str | None = None, check: bool = True) -> str:
        """Run one bcm command (bounded by ``timeout`` and the run's deadline); exit on failure (``check``)."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise SystemExit(f"out of time before: bcm {' '.join(args)}")
        done = subprocess.run(
            [*BCM, *args],
            env=self.server.env(),
            cwd=REPO,
            capture_output=True,
            text=True,
            input=stdin,
            timeout=min(timeout, left),
            check=False,
        )
        if done.returncode != 0 and check:
            raise SystemExit(
                f"bcm {' '.join(args)} failed ({done.returncode}): {done.stdout[-2000:]} "
                f"{done.stderr[-2000:]}"
            )
        return done.stdout

    def json(self, *args: str, timeout: float = 600) -> Any:
        return json.loads(self.cli(*args, "--json", timeout=timeout))


class Watch:
    """When each node of a hostlist first reached each state (read every 2 s from the API, in a thread)."""

    def __init__(self, server: Server, hostlist: str) -> None:
        self.server, self.hostlist = server, hostlist
        self.first: dict[str, dict[str, float]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)

    def _run(self) -> None:
        with httpx.Client(
            base_url=self.server.url,
            headers={"Authorization": f"Bearer {self.server.token()}"},
            timeout=30,
            trust_env=False,
        ) as api:
            while not self.stop.wait(2.0):
                try:
                    items = api.get("/api/v1/nodes", params={"nodes": self.hostlist, "limit": 1000}).json()[
                        "items"
                    ]
                except (httpx.HTTPError, ValueError, KeyError):
                    continue  # a busy server: the next reading
                now = time.monotonic()
                for n in items:
                    self.first.setdefault(n["name"], {}).setdefault(n["provision_state"], now)


def timeline(flow: str, first: dict[str, dict[str, float]], t_on: float) -> None:
    """Print when each node first showed each provisioning state, in seconds after power-on."""
    for node in sorted(first):
        steps = sorted(first[node].items(), key=lambda kv: kv[1])
        print(
            f"  {flow} {node}: " + ", ".join(f"{state} {at - t_on:.0f}s" for state, at in steps), flush=True
        )


def vm_of(bench: Bench, nodes: list[dict[str, Any]]) -> dict[str, str]:
    """node name → lab VM name, by the boot MAC."""
    by_mac = {v.mac: v.name for v in vm.load(bench.lab_dir)}
    return {n["name"]: by_mac.get((n.get("interfaces") or [{}])[0].get("mac") or "", "?") for n in nodes}


def manual(bench: Bench, count: int) -> tuple[dict[str, float], dict[str, str]]:
    """The README's PXE flow + agent deploy + wlm deploy; (vm → power-on → ready s, node → vm)."""
    hostlist = f"{MANUAL}[01-{count:02d}]"
    with Watch(bench.server, hostlist) as watch:
        t_on = time.monotonic()
        bench.cli("lab", "vm-power", "on", "--pxe", "--name", LAB)
        found = bench.json(
            "node",
            "discovered",
            "--wait",
            str(count),
            "--timeout",
            str(BOOT_WAIT_S),
            timeout=BOOT_WAIT_S + 60,
        )
        by_mac = {v.mac: v.name for v in vm.load(bench.lab_dir)}
        for i, d in enumerate(sorted(found, key=lambda d: by_mac.get(d["mac"], d["mac"])), 1):
            name = f"{MANUAL}{i:02d}"
            bench.cli("node", "assign", d["mac"], "--name", name, "--image", "lab")
            bench.cli("lab", "vm-bmc", by_mac[d["mac"]], name, "--name", LAB)
        bench.cli(
            "node", "provision", hostlist, "--wait", "--timeout", str(BOOT_WAIT_S), timeout=BOOT_WAIT_S + 60
        )
        give_up = min(bench.deadline, time.monotonic() + 900)
        while True:  # the admin waits for the inventory bcm starts after each callback (the deploy needs it)
            nodes = bench.json("node", "list", hostlist)
            if len(nodes) == count and all(n.get("inventoried_at") for n in nodes):
                break
            if time.monotonic() > give_up:
                raise SystemExit(f"manual: {hostlist} not inventoried within 900 s: {nodes}")
            time.sleep(5)
        bench.cli(
            "agent", "deploy", hostlist, "--server-url", f"http://{HEAD}:{bench.server.port}", timeout=1200
        )
        bench.cli(
            "wlm",
            "deploy",
            "slurm",
            "--name",
            MANUAL_CLUSTER,
            "--controller",
            "node01",
            "--nodes",
            f"node01,{hostlist}",
            timeout=3600,
        )
        bench.cli("node", "wait", hostlist, "--state", "ready", "--timeout", "600", timeout=660)
        time.sleep(2.5)  # one more reading by the watcher
    timeline("manual", watch.first, t_on)
    names = vm_of(bench, nodes)
    return {
        names[n]: watch.first[n]["ready"] - t_on for n in names if "ready" in watch.first.get(n, {})
    }, names


def between(bench: Bench, count: int) -> None:
    """The manual chain's nodes go (their MACs come back as new machines); its VMs off."""
    bench.cli("lab", "vm-power", "off", "--name", LAB)
    bench.cli("wlm", "rm", MANUAL_CLUSTER)
    bench.cli("node", "rm", f"{MANUAL}[01-{count:02d}]", "--yes")


def zero_touch(bench: Bench, count: int) -> tuple[dict[str, float], dict[str, str]]:
    """The README's Zero-touch set-up, then only the power buttons; (vm → power-on → ready s, node → vm)."""
    hostlist = f"{ZT}[01-{count:02d}]"
    bench.cli(
        "wlm",
        "deploy",
        "slurm",
        "--name",
        ZT_CLUSTER,
        "--controller",
        "node02",
        "--nodes",
        "node02",
        timeout=3600,
    )
    bench.cli(
        "category",
        "add",
        ZT,
        "--image",
        "lab",
        "--discover-mac-prefix",
        "52:54:00:1a",
        "--discover-names",
        f"{ZT}[01-16]",
        "--auto-provision",
        "--wlm-cluster",
        ZT_CLUSTER,
    )
    bench.cli(
        "power",
        "set-category",
        ZT,
        "--user",
        "admin",
        "--protocol",
        "ipmi",
        "--password-stdin",
        "--discover-range",
        BMC_RANGE,
        stdin=PASSWORD + "\n",
    )
    with Watch(bench.server, hostlist) as watch:
        t_on = time.monotonic()
        bench.cli("lab", "vm-power", "on", "--pxe", "--name", LAB)
        # a node that fails is reported below as never ready (the others are still timed)
        bench.cli(
            "node",
            "wait",
            hostlist,
            "--state",
            "ready",
            "--timeout",
            str(BOOT_WAIT_S),
            timeout=BOOT_WAIT_S + 60,
            check=False,
        )
        time.sleep(2.5)
    timeline("zero-touch", watch.first, t_on)
    names = vm_of(bench, bench.json("node", "list", hostlist))
    return {
        names[n]: watch.first[n]["ready"] - t_on for n in names if "ready" in watch.first.get(n, {})
    }, names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vms", type=int, default=3, help="lab VMs (TCG: each boots in minutes)")
    ap.add_argument("--timeout", type=float, default=7200.0, help="seconds for the whole run")
    args = ap.parse_args()
    if not 1 <= args.vms <= 16:
        raise SystemExit("--vms: 1 to 16")
    if os.geteuid() != 0:
        raise SystemExit("needs root (network namespaces, dnsmasq, qemu)")
    for tool in ("qemu-system-x86_64", "dnsmasq", "ipmi_sim", "slurmctld"):
        if shutil.which(tool) is None:
            raise SystemExit(f"needs {tool} (scripts/test-all installs what the lab needs)")
    work = Path(tempfile.mkdtemp(prefix="bcm-ztbench-"))
    server = Server(
        work / "state",
        host="0.0.0.0",
        extra_env={"BCM_SSH__CONNECT_TIMEOUT_S": "10", "BCM_SSH__COMMAND_TIMEOUT_S": "300"},
    )
    bench = Bench(server, time.monotonic() + args.timeout)
    results: dict[str, tuple[dict[str, float], dict[str, str]]] = {}
    try:
        server.start()
        t0 = time.monotonic()
        bench.cli(
            "lab",
            "up",
            "--nodes",
            "2",
            "--gpus",
            "0",
            "--vms",
            str(args.vms),
            "--discover-vms",
            "--vm-bmc-password-stdin",
            "--name",
            LAB,
            "--subnet",
            SUBNET,
            stdin=PASSWORD + "\n",
        )
        bench.cli("image", "build", "lab", timeout=3600)
        bench.cli("pxe", "enable", "--interface", f"{LAB}-prov", "--address", HEAD, "--range", DHCP_RANGE)
        bench.cli("node", "inventory", "node[01-02]", timeout=600)
        print(f"set-up (lab, image, PXE): {time.monotonic() - t0:.0f} s", flush=True)
        results["manual"] = manual(bench, args.vms)
        print(
            f"manual chain: {json.dumps({k: round(v) for k, v in results['manual'][0].items()})}", flush=True
        )
        between(bench, args.vms)
        results["zero-touch"] = zero_touch(bench, args.vms)
    finally:
        for argv in (["pxe", "disable"], ["lab", "down", "--name", LAB]):
            subprocess.run(
                [*BCM, *argv], env=server.env(), cwd=REPO, capture_output=True, timeout=600, check=False
            )
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(args.vms, results)


def report(count: int, results: dict[str, tuple[dict[str, float], dict[str, str]]]) -> None:
    man, zt = results["manual"][0], results["zero-touch"][0]
    print(
        f"\npower-on → ready per VM, {count} TCG VMs ({os.cpu_count()} cores; the manual chain's commands back to "
        "back, no admin time counted):"
    )
    print(f"  {'VM':6s} {'manual (s)':>12s} {'zero-touch (s)':>16s} {'zt/manual':>10s}   nodes")
    node_m = {v: n for n, v in results["manual"][1].items()}
    node_z = {v: n for n, v in results["zero-touch"][1].items()}
    for v in sorted(set(man) | set(zt)):
        m, z = man.get(v), zt.get(v)
        ratio = f"{z / m:.2f}x" if m and z else "-"
        print(
            f"  {v:6s} {m if m is not None else float('nan'):12.0f} {z if z is not None else float('nan'):16.0f} "
            f"{ratio:>10s}   {node_m.get(v, '-')} / {node_z.get(v, '-')}"
        )
    if man and zt:
        print(
            f"  last VM ready: manual {max(man.values()):.0f} s, zero-touch {max(zt.values()):.0f} s "
            f"({max(zt.values()) / max(man.values()):.2f}x; goal <= 1x, with no command after the power buttons)"
        )
    missing = count - len(zt)
    if missing:
        print(f"  {missing} VM(s) never reached ready in the zero-touch flow")


if __name__ == "__main__":
    main()
