"""Benchmark: GPU health ingest and summary queries at 10,000 nodes × 8 GPUs, SQLite and PostgreSQL.

For each backend: registers the nodes, then every node reports once (warm-up: the rows are created),
then every node reports again, timed; each report is parsed and validated from its JSON bytes, judged
and stored in its own transaction, in one thread (one core). Beside it, a raw insert of the same
sample rows (8 per transaction, plain executemany, no parsing or rules) shows what the database alone
costs. Then the
summary query (``GET /api/v1/health``) is timed in-process and over HTTP (the ASGI app in-process).

Goals (printed, never asserted): >= 1,000 node-reports/s on PostgreSQL; summary p99 < 100 ms at 10k nodes.
Usage: .venv/bin/python bench/health.py [--nodes 10000] [--gpus 8] [--queries 200] [--backends sqlite,postgresql]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
import uuid as uuidlib
from pathlib import Path
from typing import Any

from common import pct
from sqlalchemy import create_engine, insert, text

from bcm.agent.collector import collect
from bcm.agent.fake_nvml import FakeNvml
from bcm.db import session_scope
from bcm.domain.health_report import HealthReport
from bcm.lab.fakegpu import RECORDED_NVML
from bcm.models.health import HealthSample
from bcm.models.node import NodeBulkCreate
from bcm.server import prepare
from bcm.services import health, health_queries, nodes
from bcm.settings import Settings

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
FIXTURE = RECORDED_NVML / "h100_sxm_565.json"


def template(gpus: int) -> dict[str, Any]:
    """A real collector report from the recorded H100 fixture, widened to ``gpus`` GPUs."""
    nv = FakeNvml.from_file(FIXTURE)
    nv.init()
    rep: dict[str, Any] = copy.deepcopy(dict(collect(nv, gpus, hostname="x")))
    nv.shutdown()
    base = rep["gpus"]
    rep["gpus"] = [{**copy.deepcopy(base[i % len(base)]), "index": i} for i in range(gpus)]
    rep["gpu_count"] = gpus
    return rep


def bodies(names: list[str], tmpl: dict[str, Any]) -> list[bytes]:
    out = []
    for n, name in enumerate(names):
        rep = copy.deepcopy(tmpl)
        rep["hostname"] = name
        for g in rep["gpus"]:
            g["uuid"] = f"GPU-{uuidlib.UUID(int=n * 64 + g['index'])}"
        out.append(json.dumps(rep).encode())
    return out


def run(label: str, url: str, n: int, gpus: int, queries: int) -> dict[str, float]:
    state = Path(tempfile.mkdtemp(prefix="bcm-bench-health-"))
    settings = Settings(state_dir=state, database_url=url)
    engine, _ = prepare(settings)
    names = [f"gpu{i:05d}" for i in range(1, n + 1)]
    with session_scope(engine) as s:
        nodes.bulk_create(s, NodeBulkCreate(nodes=f"gpu[00001-{n:05d}]"), "bench")
    with engine.begin() as conn:
        conn.execute(text("UPDATE node SET provision_state = 'ready'"))
        ids: dict[str, int] = {str(n): int(i) for n, i in conn.execute(text("SELECT name, id FROM node"))}
    payloads = bodies(names, template(gpus))

    def ingest_round() -> float:
        t0 = time.perf_counter()
        for name, body in zip(names, payloads, strict=True):
            report = HealthReport.model_validate_json(body)
            with session_scope(engine) as s:
                health.ingest(s, ids[name], report, settings.health)
        return time.perf_counter() - t0

    warm_s = ingest_round()
    timed_s = ingest_round()

    # raw: the same 8 sample rows per node, one transaction each, nothing else
    from bcm.models.base import utcnow

    now = utcnow()
    rows: list[list[dict[str, Any]]] = [
        [
            {"node_id": ids[name], "uuid": f"raw-{ids[name]}-{i}", "gpu_index": i, "time": now, "verdict": "OK",
             "temperature_c": 30, "power_draw_w": 100.0, "utilization_gpu_pct": 0, "memory_used_mib": 1,
             "ecc_sbe_volatile": 0, "ecc_dbe_volatile": 0, "xid": None}
            for i in range(gpus)
        ]
        for name in names
    ]  # fmt: skip
    t0 = time.perf_counter()
    for batch in rows:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":  # as ingest does: no wait for the WAL flush
                conn.exec_driver_sql("SET LOCAL synchronous_commit TO OFF")
            conn.execute(insert(HealthSample), batch)
    raw_s = time.perf_counter() - t0

    lat_in: list[float] = []
    for _ in range(queries):
        t0 = time.perf_counter()
        with session_scope(engine) as s:
            summary = health_queries.summary(s, settings.health)
        lat_in.append((time.perf_counter() - t0) * 1000)
    assert summary.nodes == n and summary.gpus == n * gpus, summary

    from fastapi.testclient import TestClient

    from bcm.api.app import create_app

    app = create_app(settings, engine)
    lat_http: list[float] = []
    with TestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {settings.admin_token_file.read_text().strip()}"
        for _ in range(queries):
            t0 = time.perf_counter()
            r = client.get("/api/v1/health")
            lat_http.append((time.perf_counter() - t0) * 1000)
            assert r.status_code == 200, r.text
    engine.dispose()
    return {
        "warm-up reports/s (rows created)": n / warm_s,
        "steady reports/s (rows updated)": n / timed_s,
        "GPU samples/s (steady)": n * gpus / timed_s,
        "raw insert, same rows, reports/s": n / raw_s,
        "summary p50 ms (in-process)": statistics.median(lat_in),
        "summary p99 ms (in-process)": pct(lat_in, 99),
        "summary p50 ms (HTTP)": statistics.median(lat_http),
        "summary p99 ms (HTTP)": pct(lat_http, 99),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--backends", default="sqlite,postgresql")
    args = ap.parse_args()
    results: dict[str, dict[str, float]] = {}
    for backend in args.backends.split(","):
        if backend == "sqlite":
            url = f"sqlite:///{tempfile.mkdtemp(prefix='bcm-bench-sqlite-')}/bcm.db"
            results["SQLite"] = run("SQLite", url, args.nodes, args.gpus, args.queries)
        elif backend == "postgresql":
            schema = f"bench_{uuidlib.uuid4().hex[:10]}"
            admin = create_engine(PG_URL)
            with admin.begin() as conn:
                conn.execute(text(f'CREATE SCHEMA "{schema}"'))
            try:
                url = f"{PG_URL}?options=-csearch_path%3D{schema}"
                results["PostgreSQL"] = run("PostgreSQL", url, args.nodes, args.gpus, args.queries)
            finally:
                with admin.begin() as conn:
                    conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
                admin.dispose()
        else:
            raise SystemExit(f"unknown backend {backend!r}")
    labels = list(next(iter(results.values())))
    print(f"\nGPU health: {args.nodes} nodes x {args.gpus} GPUs, one thread (one core)")
    print(f"{'':38}" + "".join(f"{b:>14}" for b in results))
    for label in labels:
        print(f"{label:38}" + "".join(f"{results[b][label]:>14.1f}" for b in results))
    print("goals: >= 1000 node-reports/s on PostgreSQL (steady); summary p99 < 100 ms at 10k nodes")


if __name__ == "__main__":
    main()
