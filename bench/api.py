"""Benchmark: bulk-create 10,000 nodes through the API, then page and filter them.

Runs a real `bcm serve` process per backend (SQLite, PostgreSQL) side by side and prints figures.
Targets (not asserted): bulk create of 10k nodes < 5 s; list page p99 < 50 ms.
Usage: .venv/bin/python bench/api.py [--nodes 10000] [--pages 300]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from common import pct
from sqlalchemy import create_engine, text

from bcm.devserver import Server

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def run(label: str, server: Server, n: int, pages: int) -> dict[str, float]:
    http = httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {server.token()}"}, timeout=120
    )
    t0 = time.perf_counter()
    r = http.post(
        "/api/v1/nodes/bulk",
        json={
            "nodes": f"gpu[00001-{n:05d}]",
            "mac": "52:54:00:10:00:00",
            "ip": "198.18.16.0",
            "category": "gpu",
        },
    )
    r.raise_for_status()
    create_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    seen, offset = 0, 0
    while True:
        page = http.get("/api/v1/nodes", params={"limit": 1000, "offset": offset}).json()
        seen += len(page["items"])
        offset += 1000
        if offset >= page["total"]:
            break
    walk_s = time.perf_counter() - t0
    assert seen == n, seen

    rng = random.Random(1)
    lat: dict[str, list[float]] = {"page": [], "state filter": [], "hostlist filter": []}
    for _ in range(pages):
        for kind, params in (
            ("page", {"limit": 100, "offset": rng.randrange(0, n - 100)}),
            (
                "state filter",
                {"state": "registered", "category": "gpu", "limit": 100, "offset": rng.randrange(0, n - 100)},
            ),
            (
                "hostlist filter",
                {"nodes": f"gpu[{(s := rng.randrange(1, n - 64)):05d}-{s + 63:05d}]", "limit": 100},
            ),
        ):
            t = time.perf_counter()
            http.get("/api/v1/nodes", params=params).raise_for_status()
            lat[kind].append((time.perf_counter() - t) * 1000)
    print(
        f"\n[{label}] bulk create {n} nodes: {create_s:.2f} s ({n / create_s:,.0f} nodes/s); "
        f"walk all pages of 1000: {walk_s:.2f} s"
    )
    for kind, xs in lat.items():
        print(
            f"[{label}] list {kind:16s} p50 {statistics.median(xs):6.1f} ms  p99 {pct(xs, 99):6.1f} ms  (n={len(xs)})"
        )
    return {"create_s": create_s, "page_p99_ms": pct(lat["page"], 99)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=10000)
    ap.add_argument("--pages", type=int, default=300)
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        srv = Server(Path(tmp) / "sqlite")
        srv.start()
        try:
            results["sqlite"] = run("sqlite", srv, args.nodes, args.pages)
        finally:
            srv.stop()
        schema = f"bench_{uuid.uuid4().hex[:8]}"
        admin = create_engine(PG_URL)
        try:
            with admin.begin() as c:
                c.execute(text(f'CREATE SCHEMA "{schema}"'))
        except Exception as exc:  # noqa: BLE001
            print(f"\n[postgresql] skipped: {exc.__class__.__name__}: {exc}")
        else:
            srv = Server(Path(tmp) / "pg", database_url=f"{PG_URL}?options=-csearch_path%3D{schema}")
            srv.start()
            try:
                results["postgresql"] = run("postgresql", srv, args.nodes, args.pages)
            finally:
                srv.stop()
                with admin.begin() as c:
                    c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    print("\nsummary (targets: create < 5 s, page p99 < 50 ms)")
    for label, r in results.items():
        print(f"  {label:10s} create {r['create_s']:.2f} s   page p99 {r['page_p99_ms']:.1f} ms")


if __name__ == "__main__":
    main()
