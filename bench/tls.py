"""What TLS costs the agents' busiest call: health reports to a real `bcm serve`, over http and https.

Two servers side by side (one plain, one with BCM_TLS__ENABLED and bcm's CA), one node each; agents post
a real collector report (the recorded H100 fixture, 8 GPUs) the way bcm-agent does (urllib, a new
connection per report, so a full handshake each time over https), from ``--agents`` threads. Prints
reports/s and the server process's CPU milliseconds per report for each; asserts nothing.

    python bench/tls.py --reports 2000 --agents 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from health import template  # bench/health.py: a real collector report

from bcm.agent.reporter import SendError, opener_for, post_json
from bcm.devserver import Server


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (and its reaped children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(f) for f in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


def run(srv: Server, body: bytes, reports: int, agents: int) -> tuple[float, float, int]:
    """(reports/s, server CPU ms per report, failures)."""
    srv.cli("node", "add", "bench01")
    token = srv.cli("node", "token", "bench01").stdout.strip().splitlines()[-1]
    ca = str(srv.state_dir / "tls" / "ca.crt") if srv.tls else None
    opener = opener_for(ca)
    url = f"{srv.url}/boot/v1/agent/report"

    def one(_i: int) -> bool:
        try:
            post_json(url, token, body, 30, opener=opener)
            return True
        except SendError:
            return False

    with ThreadPoolExecutor(agents) as pool:  # warm up: imports, the first writes
        list(pool.map(one, range(agents * 2)))
    assert srv.proc is not None
    cpu0, t0 = cpu_s(srv.proc.pid), time.monotonic()
    with ThreadPoolExecutor(agents) as pool:
        results = list(pool.map(one, range(reports)))
    elapsed, cpu = time.monotonic() - t0, cpu_s(srv.proc.pid) - cpu0
    failures = results.count(False)
    return reports / elapsed, 1000 * cpu / reports, failures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reports", type=int, default=2000)
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--gpus", type=int, default=8)
    args = ap.parse_args()
    body = json.dumps({**template(args.gpus), "hostname": "bench01"}).encode()
    print(f"{args.reports} reports of {len(body)} bytes from {args.agents} agents, a connection each")
    print(f"{'scheme':8} {'reports/s':>10} {'server CPU ms/report':>21} {'failed':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in ("http", "https"):
            env = {"BCM_HEALTH__INGEST_PROCESSES": "0", "BCM_LOG_LEVEL": "warning"}
            srv = Server(Path(tmp) / scheme / "state", tls=scheme == "https", extra_env=env)
            srv.start()
            try:
                rate, cpu_ms, failed = run(srv, body, args.reports, args.agents)
            finally:
                srv.stop()
            print(f"{scheme:8} {rate:10.0f} {cpu_ms:21.2f} {failed:7d}")


if __name__ == "__main__":
    main()
