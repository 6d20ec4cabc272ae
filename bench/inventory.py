"""Benchmark: inventory 100 lab SSH nodes with bcm, with clush (same commands), with a bare asyncssh
script (same commands) and with `ansible -m setup`.

Needs root (it builds a lab of SSH nodes in network namespaces on 198.18.6.0/24). Prints times and
ratios; asserts nothing about speed. Goals: bcm no slower than clush, >= 5x faster than Ansible facts,
and at most 1.5x the time of bare asyncssh (connect, run the fact script, collect stdout; nothing parsed
or stored), which is the floor for what bcm does over the same library.
Usage: .venv/bin/python bench/inventory.py [--nodes 100] [--ssh-concurrency 256]
"""

from __future__ import annotations

import argparse
import asyncio
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
from bcm.lab import Lab

VENV_BIN = Path(sys.executable).parent


def timed(label: str, fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    detail = fn()
    dt = time.perf_counter() - t
    print(f"  {label:28s} {dt:7.2f} s   {detail}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--ssh-concurrency", type=int, default=256, help="bcm, clush and asyncssh alike")
    args = ap.parse_args()
    fanout = str(args.ssh_concurrency)
    if os.geteuid() != 0:
        sys.exit("bench/inventory.py needs root (network namespaces)")
    tmp = Path(tempfile.mkdtemp(prefix="bcm-bench-inv-"))
    srv = Server(tmp / "state", extra_env={"BCM_SSH__CONCURRENCY": fanout})
    srv.start()
    lab = Lab(tmp / "lab", "bcmbench", subnet="198.18.6.0/24")
    try:
        http = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {srv.token()}"}, timeout=300)
        pub = http.get("/api/v1/ssh/public-key").json()["public_key"]
        t = time.perf_counter()
        nodes = lab.up(args.nodes, [pub])
        print(f"lab: {len(nodes)} SSH nodes up in {time.perf_counter() - t:.1f} s")
        for n in nodes:
            http.post(
                "/api/v1/nodes",
                json={"name": n.name, "mac": n.mac, "ip": n.ip, "ssh_host_key": n.host_key_public},
            ).raise_for_status()
        names = fold_hostlist([n.name for n in nodes])
        key = srv.state_dir / "ssh" / "id_ed25519"
        known = tmp / "known_hosts"
        known.write_text(lab.known_hosts())
        ssh_opts = (
            f"-i {key} -o UserKnownHostsFile={known} -o GlobalKnownHostsFile=/dev/null "
            "-o StrictHostKeyChecking=yes -o BatchMode=yes -o IdentitiesOnly=yes -F /dev/null"
        )
        ips = ",".join(n.ip for n in nodes)

        def bcm() -> str:
            r = http.post("/api/v1/nodes/actions/inventory", json={"nodes": names})
            assert r.status_code == 200, r.text
            op = r.json()
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                o = http.get(f"/api/v1/operations/{op['operation_id']}").json()
                if o["state"] not in ("pending", "running"):
                    oks = sum(r["status"] == "ok" for r in o["results"].values())
                    return f"{oks}/{len(nodes)} ok, facts parsed and stored"
                time.sleep(0.05)
            return "timed out"

        def clush() -> str:
            if not shutil.which("clush"):
                return "clush not installed"
            r = subprocess.run(
                ["clush", "-w", ips, "-f", fanout, "-o", ssh_opts, "-l", "root", "-B", FACT_SCRIPT],
                capture_output=True,
                text=True,
                timeout=600,
            )
            return f"exit {r.returncode}, {len(r.stdout) // 1024} KiB output (not parsed or stored)"

        def bare_asyncssh() -> str:
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
                limit = asyncio.Semaphore(args.ssh_concurrency)

                async def bounded(ip: str) -> tuple[int | None, str]:
                    async with limit:
                        return await asyncio.wait_for(one(ip), 80)

                return await asyncio.wait_for(
                    asyncio.gather(*(bounded(n.ip) for n in nodes), return_exceptions=True), 600
                )

            results = asyncio.run(run_all())
            ok = [r for r in results if not isinstance(r, BaseException) and r[0] == 0]
            errors = sorted({type(r).__name__ for r in results if isinstance(r, BaseException)})
            size = sum(len(r[1]) for r in ok)
            return f"{len(ok)}/{len(nodes)} exit 0, {size // 1024} KiB output (not parsed or stored)" + (
                f"; errors: {', '.join(errors)}" if errors else ""
            )

        def ansible() -> str:
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
            return f"exit {r.returncode}, {good}/{len(nodes)} SUCCESS"

        print(f"\ninventory of {len(nodes)} nodes (same machine, run one after another):")
        t_bcm = timed("bcm (asyncssh, parse, store)", bcm)
        t_clush = timed(f"clush -f {fanout} (same script)", clush)
        t_bare = timed(f"bare asyncssh, {fanout} at once", bare_asyncssh)
        t_ans = timed("ansible -m setup -f 100", ansible)
        print(
            f"\nratios: clush/bcm = {t_clush / t_bcm:.2f}x   ansible/bcm = {t_ans / t_bcm:.2f}x"
            f"   bcm/asyncssh = {t_bcm / t_bare:.2f}x   (goals: >= 1.0x, >= 5x and <= 1.5x)"
        )
    finally:
        lab.down()
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
