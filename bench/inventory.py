"""Benchmark: inventory up to 1,000 lab SSH nodes with bcm, with clush (same commands), with a bare
asyncssh script (same commands) and with `ansible -m setup`, at one or more fan-outs.

Needs root (it builds a lab of SSH nodes in network namespaces on 198.18.40.0/24, /23 or /22 as the
node count needs). Prints times, hosts ok for each peer and ratios; asserts nothing about speed. Goals:
every host ok for bcm at every fan-out (a fan-out too high for the machine costs time, not hosts: bcm
retries transient connect failures and backs its concurrency off), bcm no slower than clush, >= 5x
faster than Ansible facts, and at most 1.1x the time of the fastest bare-asyncssh run that lost no host
(connect, run the fact script, collect stdout; nothing parsed or stored, no retries).
Usage: .venv/bin/python bench/inventory.py [--nodes 1000] [--fanouts 128,256,512]
       [--peers bcm,asyncssh,clush,ansible]
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncssh
import httpx

from bcm.agent.facts import FACT_SCRIPT
from bcm.devserver import Server
from bcm.domain.naming import fold_hostlist
from bcm.lab import Lab, net

VENV_BIN = Path(sys.executable).parent
PEERS = ("bcm", "asyncssh", "clush", "ansible")
MAX_NODES = 1000


def subnet_for(nodes: int) -> str:
    """The smallest lab subnet on 198.18.40.0 that holds the nodes (a /22 holds 1,012)."""
    for prefix in (24, 23, 22):
        subnet = f"198.18.40.0/{prefix}"
        if net.max_nodes(ipaddress.IPv4Network(subnet)) >= nodes:
            return subnet
    raise SystemExit(f"at most {MAX_NODES} nodes")


def timed(label: str, fn) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """Run fn (which returns (hosts ok, detail)), print a row, return (seconds, hosts ok)."""
    t = time.perf_counter()
    ok, detail = fn()
    dt = time.perf_counter() - t
    print(f"  {label:34s} {dt:7.2f} s   {detail}", flush=True)
    return dt, ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=100, help=f"lab SSH nodes, 1 to {MAX_NODES}")
    ap.add_argument(
        "--fanouts", default="256", help="comma-separated fan-outs: bcm, clush and asyncssh alike"
    )
    ap.add_argument("--ssh-concurrency", type=int, help="one fan-out (same as --fanouts N)")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of {', '.join(PEERS)}")
    args = ap.parse_args()
    fanouts = [args.ssh_concurrency] if args.ssh_concurrency else [int(f) for f in args.fanouts.split(",")]
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if unknown := set(peers) - set(PEERS):
        sys.exit(f"unknown peers: {', '.join(sorted(unknown))} (choose from {', '.join(PEERS)})")
    if not 1 <= args.nodes <= MAX_NODES:
        sys.exit(f"--nodes: 1 to {MAX_NODES}")
    if os.geteuid() != 0:
        sys.exit("bench/inventory.py needs root (network namespaces)")
    tmp = Path(tempfile.mkdtemp(prefix="bcm-bench-inv-"))
    srv = Server(tmp / "state", extra_env={"BCM_SSH__CONCURRENCY": str(fanouts[0])})
    srv.start()
    lab = Lab(tmp / "lab", "bcmbench", subnet=subnet_for(args.nodes))
    try:
        http = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {srv.token()}"}, timeout=300)
        pub = http.get("/api/v1/ssh/public-key").json()["public_key"]
        t = time.perf_counter()
        nodes = lab.up(args.nodes, [pub])
        print(f"lab: {len(nodes)} SSH nodes up in {time.perf_counter() - t:.1f} s")
        t = time.perf_counter()
        for n in nodes:
            http.post(
                "/api/v1/nodes",
                json={"name": n.name, "mac": n.mac, "ip": n.ip, "ssh_host_key": n.host_key_public},
            ).raise_for_status()
        print(f"{len(nodes)} nodes registered in {time.perf_counter() - t:.1f} s")
        names = fold_hostlist([n.name for n in nodes])
        key = srv.state_dir / "ssh" / "id_ed25519"
        known = tmp / "known_hosts"
        known.write_text(lab.known_hosts())
        ssh_opts = (
            f"-i {key} -o UserKnownHostsFile={known} -o GlobalKnownHostsFile=/dev/null "
            "-o StrictHostKeyChecking=yes -o BatchMode=yes -o IdentitiesOnly=yes -F /dev/null"
        )
        ips = ",".join(n.ip for n in nodes)
        fanout = fanouts[0]

        def bcm() -> tuple[int, str]:
            r = http.post("/api/v1/nodes/actions/inventory", json={"nodes": names})
            assert r.status_code == 200, r.text
            op = r.json()
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline:  # bounded
                o = http.get(f"/api/v1/operations/{op['operation_id']}").json()
                if o["state"] not in ("pending", "running"):
                    results = o["results"].values()
                    oks = sum(r["status"] == "ok" for r in results)
                    retried = sum((r.get("attempts") or 1) > 1 for r in results)
                    errors = sorted({r["status"] for r in results if r["status"] != "ok"})
                    return oks, f"{oks}/{len(nodes)} ok, facts parsed and stored" + (
                        f", {retried} needed a retry" if retried else ""
                    ) + (f"; failed: {', '.join(errors)}" if errors else "")
                time.sleep(0.1)
            return 0, "timed out"

        def clush() -> tuple[int, str]:
            if not shutil.which("clush"):
                return 0, "clush not installed"
            r = subprocess.run(
                ["clush", "-w", ips, "-f", str(fanout), "-o", ssh_opts, "-l", "root", "-B", FACT_SCRIPT],
                capture_output=True,
                text=True,
                timeout=900,
            )
            # clush names each host that failed on stderr ("clush: 198.18.40.11: exited with exit code 255")
            failed = {
                line.split(":")[1].strip()
                for line in r.stderr.splitlines()
                if "exited with exit code" in line
            }
            ok = len(nodes) - len(failed)
            return ok, f"{ok}/{len(nodes)} exit 0, {len(r.stdout) // 1024} KiB output (not parsed or stored)"

        def bare_asyncssh() -> tuple[int, str]:
            """The same script over asyncssh, nothing else: same key, same pinned host keys, same fan-out."""

            async def one(ip: str) -> tuple[int | None, str]:
                async with asyncssh.connect(
                    ip,
                    username="root",
                    client_keys=[str(key)],
                    known_hosts=str(known),  # the lab's pinned host keys, as for clush and Ansible
                    agent_path=None,
                    config=None,  # not the invoking user's ~/.ssh/config
                    connect_timeout=10,
                ) as conn:
                    done = await conn.run(FACT_SCRIPT, check=False, timeout=60)
                    out = done.stdout
                    return done.exit_status, out if isinstance(out, str) else ""

            async def run_all() -> list[tuple[int | None, str] | BaseException]:
                limit = asyncio.Semaphore(fanout)

                async def bounded(ip: str) -> tuple[int | None, str]:
                    async with limit:
                        return await asyncio.wait_for(one(ip), 80)

                return await asyncio.wait_for(
                    asyncio.gather(*(bounded(n.ip) for n in nodes), return_exceptions=True), 900
                )

            results = asyncio.run(run_all())
            ok = [r for r in results if not isinstance(r, BaseException) and r[0] == 0]
            errors = sorted({type(r).__name__ for r in results if isinstance(r, BaseException)})
            size = sum(len(r[1]) for r in ok)
            detail = f"{len(ok)}/{len(nodes)} exit 0, {size // 1024} KiB output (not parsed or stored)"
            return len(ok), detail + (f"; errors: {', '.join(errors)}" if errors else "")

        def ansible() -> tuple[int, str]:
            inv = tmp / "hosts.ini"
            inv.write_text("[lab]\n" + "\n".join(f"{n.name} ansible_host={n.ip}" for n in nodes) + "\n")
            env = {
                **os.environ,
                "ANSIBLE_HOST_KEY_CHECKING": "True",
                "ANSIBLE_SSH_ARGS": ssh_opts.replace(f"-i {key} ", ""),
                "ANSIBLE_PRIVATE_KEY_FILE": str(key),
                "ANSIBLE_REMOTE_USER": "root",
                "ANSIBLE_STDOUT_CALLBACK": "oneline",
                "ANSIBLE_PYTHON_INTERPRETER": "/usr/bin/python3",
                "ANSIBLE_FORKS": "100",
            }
            r = subprocess.run(
                [str(VENV_BIN / "ansible"), "all", "-i", str(inv), "-m", "setup", "-f", "100"],
                capture_output=True,
                text=True,
                env=env,
                timeout=900,
            )
            good = r.stdout.count("SUCCESS")
            return good, f"exit {r.returncode}, {good}/{len(nodes)} SUCCESS"

        runs: dict[tuple[str, int], tuple[float, int]] = {}
        for fanout in fanouts:
            if "bcm" in peers and fanout != fanouts[0]:
                srv.stop()  # the server's fan-out is a setting: restart it on the same state (nodes stay)
                srv = Server(srv.state_dir, extra_env={"BCM_SSH__CONCURRENCY": str(fanout)})
                srv.start()
                http = httpx.Client(
                    base_url=srv.url, headers={"Authorization": f"Bearer {srv.token()}"}, timeout=300
                )
            print(
                f"\ninventory of {len(nodes)} nodes at a fan-out of {fanout} (same machine, one after another):"
            )
            if "bcm" in peers:
                runs["bcm", fanout] = timed("bcm (asyncssh, parse, store)", bcm)
            if "clush" in peers:
                runs["clush", fanout] = timed(f"clush -f {fanout} (same script)", clush)
            if "asyncssh" in peers:
                runs["asyncssh", fanout] = timed(f"bare asyncssh, {fanout} at once", bare_asyncssh)
            if "ansible" in peers and fanout == fanouts[0]:
                runs["ansible", 100] = timed("ansible -m setup -f 100", ansible)
        summarize(runs, len(nodes), fanouts)
    finally:
        lab.down()
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def summarize(runs: dict[tuple[str, int], tuple[float, int]], nodes: int, fanouts: list[int]) -> None:
    """Side by side: hosts ok and seconds per peer and fan-out, and bcm against the best lossless bare run."""
    print(f"\n{'peer':10s}" + "".join(f"{'fan-out ' + str(f):>22s}" for f in fanouts))
    for peer in PEERS:
        cells = [runs.get((peer, f)) for f in fanouts]
        if any(cells):
            print(
                f"{peer:10s}"
                + "".join(f"{f'{c[1]}/{nodes} ok {c[0]:6.1f} s' if c else '-':>22s}" for c in cells)
            )
    lossless = [t for (peer, _), (t, ok) in runs.items() if peer == "asyncssh" and ok == nodes]
    for f in fanouts:
        if ("bcm", f) in runs:
            t, ok = runs["bcm", f]
            vs = (
                f"{t / min(lossless):.2f}x the fastest lossless bare asyncssh"
                if lossless
                else "no lossless bare run"
            )
            print(f"bcm at {f}: {ok}/{nodes} ok, {vs}  (goals: {nodes}/{nodes}, <= 1.1x)")
    if ("ansible", 100) in runs and runs.get(("bcm", fanouts[0])):
        print(f"ansible/bcm = {runs['ansible', 100][0] / runs['bcm', fanouts[0]][0]:.2f}x (goal >= 5x)")
    if runs.get(("clush", fanouts[0])) and runs.get(("bcm", fanouts[0])):
        print(f"clush/bcm = {runs['clush', fanouts[0]][0] / runs['bcm', fanouts[0]][0]:.2f}x (goal >= 1.0x)")


if __name__ == "__main__":
    main()
