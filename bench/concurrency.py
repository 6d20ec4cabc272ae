"""Benchmark: concurrent mixed clients against one `bcm serve` on SQLite (#27), and /healthz meanwhile.

Clients mix PATCH, drain/resume verbs, reads and health reports; a separate prober asks /healthz once a
second throughout. Prints 5xx count, p50/p99 of all requests and the /healthz times, beside the figures
measured before the fix (issue #27: 50 clients got 503s and requests over 5 s, /healthz 10-30 s; 200 clients:
195 of 359 requests 503). Not asserted; loopback only; bounded in requests.
Usage: .venv/bin/python bench/concurrency.py [--clients 50 200] [--requests 600]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from common import pct

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bcm.devserver import Server  # noqa: E402
from tests.api.test_health_api import REPORT_URL, report  # noqa: E402

BEFORE = {50: "503s, requests over 5 s, /healthz 10-30 s", 200: "195 of 359 requests 503"}


def run(clients: int, total: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bcm-bench-conc-") as tmp:
        srv = Server(Path(tmp) / "state")
        srv.start()
        try:
            auth = {"Authorization": f"Bearer {srv.token()}"}
            with httpx.Client(base_url=srv.url, headers=auth, timeout=120) as c:
                assert c.post("/api/v1/nodes/bulk", json={"nodes": "b[1-5]"}).status_code == 201
                tokens = {f"b{i}": c.post(f"/api/v1/nodes/b{i}/token").json()["token"] for i in range(1, 6)}
            reports = {n: report(n) for n in tokens}
            rng = random.Random(27)

            def one(i: int) -> tuple[int, float]:
                node = f"b{rng.randint(1, 5)}"
                with httpx.Client(base_url=srv.url, headers=auth, timeout=120) as c:
                    t0 = time.perf_counter()
                    try:
                        kind = i % 10  # five in ten PATCH: #27's "mixing PATCH and verbs"
                        if kind in (0, 5, 6, 7, 8):
                            r = c.patch(f"/api/v1/nodes/{node}", json={"comment": f"c{i}"})
                        elif kind == 1:
                            r = c.post("/api/v1/nodes/actions/drain", json={"nodes": node})
                        elif kind == 2:
                            r = c.post("/api/v1/nodes/actions/resume", json={"nodes": node})
                        elif kind == 3:
                            r = c.get("/api/v1/nodes", params={"limit": 50})
                        elif kind == 4:
                            r = c.get(f"/api/v1/nodes/{node}")
                        else:
                            r = c.post(
                                REPORT_URL,
                                json=reports[node],
                                headers={"Authorization": f"Bearer {tokens[node]}"},
                            )
                        return r.status_code, time.perf_counter() - t0
                    except httpx.HTTPError:
                        return 599, time.perf_counter() - t0

            healthz: list[float] = []
            done = threading.Event()

            def probe() -> None:
                while not done.is_set():
                    t0 = time.perf_counter()
                    with contextlib.suppress(httpx.HTTPError):
                        httpx.get(f"{srv.url}/healthz", timeout=60)
                    healthz.append(time.perf_counter() - t0)
                    done.wait(1.0)

            prober = threading.Thread(target=probe)
            prober.start()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                got = list(pool.map(one, range(total)))
            wall = time.perf_counter() - t0
            done.set()
            prober.join()
            times = [t for _, t in got]
            errors = sum(1 for s, _ in got if s >= 500)
            print(
                f"{clients:>4} clients, {total} requests in {wall:.1f}s: 5xx {errors}, p50 {pct(times, 50) * 1000:.0f} ms,"
                f" p99 {pct(times, 99) * 1000:.0f} ms; /healthz max {max(healthz) * 1000:.0f} ms"
                f" (p50 {pct(healthz, 50) * 1000:.1f} ms, {len(healthz)} probes)"
                f" | before #27: {BEFORE.get(clients, '-')}"
            )
        finally:
            srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, nargs="+", default=[50, 200])
    ap.add_argument("--requests", type=int, default=600)
    args = ap.parse_args()
    for clients in args.clients:
        run(clients, args.requests)


if __name__ == "__main__":
    main()
