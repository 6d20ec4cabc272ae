"""Benchmark: GPU health ingest and summary queries at 10,000 nodes × 8 GPUs, SQLite and PostgreSQL.

In-process mode (``--mode inproc``), for each backend: registers the nodes, then every node reports once
(warm-up: the rows are created), then every node reports again, timed; each report is parsed and
validated from its JSON bytes, judged and stored in its own transaction, in one thread (one core).
Beside it, a raw insert of the same history rows (one per report and transaction, plain executemany, no
parsing or rules) shows what the database alone costs. Then the summary query (``GET /api/v1/health``) is timed
in-process and over HTTP (the ASGI app in-process).

HTTP mode (``--mode http``), for each backend: starts a real ``bcm serve`` on 127.0.0.1 with a fresh
database, registers the nodes through the API (addresses from 198.18.0.0/15, never contacted), issues
each node its agent token, then ``--agents`` concurrent agents (asyncio, plain HTTP/1.1 on one keep-alive connection each, in ``--client-procs``
processes) POST the nodes' reports to ``/boot/v1/agent/report`` with the node tokens: every node once
(warm-up: the rows are created, then ANALYZE, as autovacuum would do within a minute of a real
server's start), then ``--reports`` reports timed (default 3 x nodes), each round bounded by ``--duration``.
Prints reports/s, latency p50/p99, non-2xx answers, CPU used by server and clients, and the raw insert
of the same rows measured against the same database in the same run (one transaction per report, and
500 reports per transaction as the server's batches write them), with the database's own durability
settings, as the server keeps them (PostgreSQL ``synchronous_commit`` untouched).

Goals (printed, never asserted): >= 1,000 node-reports/s on PostgreSQL; summary p99 < 100 ms at 10k
nodes; over HTTP at 50 agents: PostgreSQL >= 1,000 reports/s with p99 < 250 ms, SQLite >= 300/s, no errors.
Usage: .venv/bin/python bench/health.py [--nodes 10000] [--gpus 8] [--queries 200]
    [--backends sqlite,postgresql] [--mode inproc,http] [--agents 50] [--reports N] [--duration 60]
    [--client-procs 1] [--server-env BCM_DB__THREADS=64 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid as uuidlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from common import pct
from sqlalchemy import create_engine, insert, text
from sqlalchemy.engine import Engine

from bcm.agent.collector import collect
from bcm.agent.fake_nvml import FakeNvml
from bcm.agent.reporter import REPORT_PATH
from bcm.db import make_engine, session_scope
from bcm.devserver import Server
from bcm.domain.health_report import HealthReport
from bcm.lab.fakegpu import RECORDED_NVML
from bcm.models.health import HealthRecord
from bcm.models.node import NodeBulkCreate
from bcm.server import prepare
from bcm.services import health, health_queries, nodes
from bcm.settings import DbSettings, Settings

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


def bodies(names: list[str], tmpl: dict[str, Any], start: int = 0) -> list[bytes]:
    """One report per node; ``start`` is the first node's index (GPU UUIDs are unique per index)."""
    out = []
    for n, name in enumerate(names, start):
        rep = copy.deepcopy(tmpl)
        rep["hostname"] = name
        for g in rep["gpus"]:
            g["uuid"] = f"GPU-{uuidlib.UUID(int=n * 64 + g['index'])}"
        out.append(json.dumps(rep).encode())
    return out


def raw_insert(engine: Engine, node_ids: list[int], gpus: int, per_txn: int = 1) -> float:
    """Seconds to insert a history row of ``gpus`` readings per node, ``per_txn`` nodes per transaction,
    nothing else."""
    from bcm.models.base import utcnow

    now = utcnow()
    rows: list[dict[str, Any]] = [
        {
            "node_id": node_id,
            "time": now,
            "gpus": [[i, f"raw-{node_id}-{i}", "OK", 30, 100.0, 0, 1, 0, 0, None] for i in range(gpus)],
        }
        for node_id in node_ids
    ]
    t0 = time.perf_counter()
    for k in range(0, len(rows), per_txn):  # the database's own durability settings, as ingest has them
        with engine.begin() as conn:
            conn.execute(insert(HealthRecord), rows[k : k + per_txn])
    return time.perf_counter() - t0


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

    raw_s = raw_insert(engine, [ids[name] for name in names], gpus)

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
    shutil.rmtree(state, ignore_errors=True)
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


# --- over HTTP: a real `bcm serve`, agents posting reports ------------------------------------------


def _ticks_by_part(server_pid: int) -> dict[str, dict[int, int]]:
    """CPU ticks of each process that serves the reports: the server, its children (the ingest writer
    processes), and PostgreSQL's processes (none for SQLite), keyed by part, then pid."""
    stats: dict[int, tuple[int, str, int]] = {}  # pid -> (ppid, comm, ticks)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        comm = raw[raw.index("(") + 1 : raw.rindex(")")]
        fields = raw.rsplit(")", 1)[1].split()
        stats[int(entry.name)] = (int(fields[1]), comm, int(fields[11]) + int(fields[12]))
    parts: dict[str, dict[int, int]] = {"server": {}, "writers": {}, "database": {}}
    for pid, (ppid, comm, ticks) in stats.items():
        if pid == server_pid:
            parts["server"][pid] = ticks
        elif ppid == server_pid or stats.get(ppid, (0, "", 0))[0] == server_pid:
            parts["writers"][pid] = ticks
        elif comm.startswith("postgres"):
            parts["database"][pid] = ticks
    return parts


def _cpu_between(before: dict[str, dict[int, int]], after: dict[str, dict[int, int]]) -> dict[str, float]:
    """Seconds of CPU each part used between two :func:`_ticks_by_part` readings."""
    hz = os.sysconf("SC_CLK_TCK")
    return {part: sum(t - before[part].get(pid, 0) for pid, t in after[part].items()) / hz for part in after}


def _ingest_counts(admin: httpx.Client) -> tuple[float, float]:
    """(reports, batches) the server has written so far, from its /metrics."""
    values = dict(
        line.rsplit(" ", 1)
        for line in admin.get("/metrics", params={"nodes": "gpu00001"}).text.splitlines()
        if line.startswith("bcm_health_ingest_")
    )
    return float(values["bcm_health_ingest_reports_total"]), float(values["bcm_health_ingest_batches_total"])


def _machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, all cores (Linux /proc/stat)."""
    cpu = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = cpu[3] + cpu[4]
    return sum(cpu) - idle, sum(cpu)


async def _issue_tokens(url: str, admin: str, names: list[str], concurrency: int) -> dict[str, str]:
    """One agent token per node (``POST /api/v1/nodes/{name}/token``), a bounded number at a time."""
    limit = asyncio.Semaphore(concurrency)
    tokens: dict[str, str] = {}
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=60, trust_env=False
    ) as client:

        async def one(name: str) -> None:
            async with limit:
                r = await client.post(f"/api/v1/nodes/{name}/token")
                r.raise_for_status()
                tokens[name] = r.json()["token"]

        await asyncio.wait_for(asyncio.gather(*(one(n) for n in names)), timeout=60 + len(names) * 0.5)
    return tokens


async def _agents(
    url: str, jobs: list[tuple[str, bytes]], agents: int, count: int | None, duration_s: float
) -> dict[str, Any]:
    """``agents`` concurrent agents, each posting the reports of its own nodes (a node is only ever
    posted by one agent, one report at a time, as on a real cluster), round-robin over them.

    ``count=None``: every node reports exactly once (the warm-up). Otherwise ``count`` reports in all.
    Bounded by ``duration_s`` in any case (and every request by its timeout).
    """
    agents = max(1, min(agents, len(jobs)))
    slices = [jobs[k::agents] for k in range(agents)]
    deadline = time.monotonic() + duration_s
    sent = 0
    lat: list[float] = []
    statuses: Counter[int] = Counter()
    failures: Counter[str] = Counter()
    samples: list[str] = []
    # one keep-alive connection per agent, as real agents have, spoken in plain HTTP/1.1 over asyncio
    # streams: the requests are built once, so the client's CPU (it shares the cores with the server)
    # goes to sending and reading, not to an HTTP library's bookkeeping
    u = httpx.URL(url)
    host, port = u.host, u.port or 80

    def request(token: str, body: bytes) -> bytes:
        head = (
            f"POST {REPORT_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    async def exchange(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: bytes
    ) -> tuple[int, bytes]:
        writer.write(req)
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        code = int(lines[0].split(b" ", 2)[1])
        length = 0
        for line in lines[1:]:
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        return code, await reader.readexactly(length)

    async def agent(mine: list[tuple[str, bytes]]) -> None:
        nonlocal sent
        reqs = [request(token, body) for token, body in mine]
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            for k in range(len(reqs) if count is None else 1 << 62):
                if time.monotonic() >= deadline or (count is not None and sent >= count):
                    return
                sent += 1
                t = time.perf_counter()
                try:
                    if conn is None:
                        conn = await asyncio.wait_for(asyncio.open_connection(host, port), 30)
                    code, text_ = await asyncio.wait_for(exchange(*conn, reqs[k % len(reqs)]), 30)
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError) as exc:
                    failures[type(exc).__name__] += 1
                    if conn is not None:
                        conn[1].close()
                    conn = None
                    continue
                lat.append((time.perf_counter() - t) * 1000)
                statuses[code] += 1
                if not 200 <= code < 300 and len(samples) < 5:
                    samples.append(f"{code} {text_[:300].decode(errors='replace')}")
        finally:
            if conn is not None:
                conn[1].close()

    t0 = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(agent(m) for m in slices)), timeout=duration_s + 60)
    elapsed = time.perf_counter() - t0
    return {
        "lat": lat,
        "statuses": dict(statuses),
        "failures": dict(failures),
        "samples": samples,
        "elapsed": elapsed,
    }


def _client_proc(
    url: str,
    tokens: list[str],
    start: int,
    gpus: int,
    agents: int,
    count: int,
    duration_s: float,
    barrier: Any,
    out: Any,
) -> None:
    """One client process: its own slice of nodes (indices ``start``...), warm-up round, timed round."""
    # httpcore tries `import sniffio` on every request; where it is not installed that is a failed
    # search of sys.path each time, a real share of the client's CPU. None here makes it fail at once.
    sys.modules.setdefault("sniffio", None)  # type: ignore[arg-type]
    try:
        names = [f"gpu{i:05d}" for i in range(start + 1, start + len(tokens) + 1)]
        jobs = list(zip(tokens, bodies(names, template(gpus), start), strict=True))
        wait = duration_s + 120
        barrier.wait(timeout=wait)  # everyone set up
        warm = asyncio.run(_agents(url, jobs, agents, None, duration_s))
        barrier.wait(timeout=wait)  # everyone warmed up
        barrier.wait(timeout=wait)  # the database's statistics are fresh: the timed round starts together
        cpu0 = time.process_time()
        timed = asyncio.run(_agents(url, jobs, agents, count, duration_s))
        timed["cpu_s"] = time.process_time() - cpu0
        out.put({"warm": warm, "timed": timed})
    except BaseException:
        barrier.abort()  # the parent and the other clients stop waiting at once
        out.put({"error": traceback.format_exc()})
        raise


def http_run(
    label: str,
    url: str,
    n: int,
    gpus: int,
    agents: int,
    reports: int,
    duration_s: float,
    procs: int,
    server_env: dict[str, str] | None = None,
) -> dict[str, float]:
    """A real `bcm serve` on ``url``: register ``n`` nodes, a token each, then agents post reports."""
    tmp = Path(tempfile.mkdtemp(prefix="bcm-bench-health-http-"))
    srv = Server(
        tmp / "state",
        database_url=url,
        # the server's defaults otherwise; note that all agents share one address (127.0.0.1), so the
        # failed-auth brake (BCM_HTTP__AUTH_FAILURES_PER_MINUTE) would answer 429 to all of them after
        # a few bad tokens: look for 401s among the samples first
        extra_env={"BCM_LOG_LEVEL": "warning", **(server_env or {})},
    )
    srv.start()
    assert srv.proc is not None
    print(
        f"[{label} HTTP] bcm serve pid {srv.proc.pid} on {srv.url} (to profile: py-spy record --pid ...)",
        flush=True,
    )
    engine = None
    children: list[Any] = []
    try:
        admin = httpx.Client(
            base_url=srv.url, headers={"Authorization": f"Bearer {srv.token()}"}, timeout=120, trust_env=False
        )
        # node addresses from 198.18.0.0/15 (benchmark range); registered, never contacted
        r = admin.post("/api/v1/nodes/bulk", json={"nodes": f"gpu[00001-{n:05d}]", "ip": "198.18.16.1"})
        assert r.status_code == 201, r.text
        engine = make_engine(url, DbSettings())
        with engine.begin() as conn:  # in service, as the in-process mode (a FAIL would ask for a drain)
            conn.execute(text("UPDATE node SET provision_state = 'ready'"))
            ids: dict[str, int] = {str(a): int(b) for a, b in conn.execute(text("SELECT name, id FROM node"))}
        names = [f"gpu{i:05d}" for i in range(1, n + 1)]
        t0 = time.perf_counter()
        tokens = asyncio.run(_issue_tokens(srv.url, srv.token(), names, 8))
        token_s = time.perf_counter() - t0

        per = -(-n // max(1, min(procs, agents, n)))
        parts = [(start, names[start : start + per]) for start in range(0, n, per)]
        ctx = mp.get_context("spawn")
        barrier = ctx.Barrier(len(parts) + 1)
        out = ctx.Queue()
        for p, (start, mine) in enumerate(parts):
            share = agents // len(parts) + (p < agents % len(parts))
            child = ctx.Process(
                target=_client_proc,
                args=(
                    srv.url,
                    [tokens[x] for x in mine],
                    start,
                    gpus,
                    share,
                    -(-reports // len(parts)),
                    duration_s,
                    barrier,
                    out,
                ),
                daemon=True,
            )
            child.start()
            children.append(child)
        wait = duration_s + 180
        finished = threading.Event()

        def watchdog() -> None:  # a client that dies (before its own try, say) must not leave us waiting
            while not finished.wait(0.5):
                if any(c.exitcode not in (None, 0) for c in children):
                    barrier.abort()
                    return

        threading.Thread(target=watchdog, daemon=True).start()

        def failure() -> RuntimeError:
            errors = [f"exit codes {[c.exitcode for c in children]}"]
            with contextlib.suppress(queue.Empty):
                while True:
                    errors.append(out.get(timeout=2).get("error", ""))
            return RuntimeError("a client process failed: " + "\n".join(errors))

        try:
            barrier.wait(timeout=wait)
            t_warm = time.perf_counter()
            barrier.wait(timeout=wait)
            warm_s = time.perf_counter() - t_warm
            # the warm-up created every row; a server that has run a minute has had them analyzed by
            # autovacuum, and its statements planned for tables of that size, not for empty ones
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.execute(text("ANALYZE"))
            written0 = _ingest_counts(admin)
            barrier.wait(timeout=wait)
        except threading.BrokenBarrierError:
            raise failure() from None
        print(
            f"[{label} HTTP] {n} tokens in {token_s:.1f} s; warm-up round {warm_s:.1f} s; timed round...",
            flush=True,
        )
        parts0, busy0 = _ticks_by_part(srv.proc.pid), _machine_busy()
        t_timed = time.perf_counter()
        results: list[dict[str, Any]] = []
        give_up = time.monotonic() + wait
        while len(results) < len(children) and time.monotonic() < give_up:
            try:
                results.append(out.get(timeout=1))
            except queue.Empty:
                if any(c.exitcode not in (None, 0) for c in children):
                    raise failure() from None
        finished.set()
        if len(results) < len(children) or any("error" in r for r in results):
            raise RuntimeError(
                "a client process failed or timed out: " + "\n".join(r.get("error", "") for r in results)
            )
        timed_s = time.perf_counter() - t_timed
        cpu = _cpu_between(parts0, _ticks_by_part(srv.proc.pid))
        busy1 = _machine_busy()
        written = [b - a for a, b in zip(written0, _ingest_counts(admin), strict=True)]
        for child in children:
            child.join(timeout=30)

        def merged(phase: str) -> tuple[list[float], Counter[int], Counter[str], list[str]]:
            lat: list[float] = []
            st: Counter[int] = Counter()
            fails: Counter[str] = Counter()
            samples: list[str] = []
            for res in results:
                lat += res[phase]["lat"]
                st.update({int(k): v for k, v in res[phase]["statuses"].items()})
                fails.update(res[phase]["failures"])
                samples += res[phase]["samples"]
            return lat, st, fails, samples

        warm_lat, warm_st, warm_f, warm_samples = merged("warm")
        lat, st, fails, samples = merged("timed")
        ok = sum(v for k, v in st.items() if 200 <= k < 300)
        bad = sum(v for k, v in st.items() if not 200 <= k < 300)
        warm_ok = sum(v for k, v in warm_st.items() if 200 <= k < 300)
        client_cpu = sum(res["timed"]["cpu_s"] for res in results)
        busy_pct = 100 * (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1])
        print(
            f"[{label} HTTP] warm-up {warm_ok}/{n} ok; "
            f"timed: {ok + bad} answers, statuses {dict(sorted(st.items()))}, transport errors {dict(fails)}"
        )
        for text_ in (warm_samples + samples)[:5]:
            print(f"[{label} HTTP] non-2xx sample: {text_}")
        if warm_f:
            print(f"[{label} HTTP] warm-up transport errors: {dict(warm_f)}")
        cpu["clients"] = client_cpu
        answered = max(1, ok + bad)
        print(
            f"[{label} HTTP] CPU during the timed round, ms per report: "
            + ", ".join(f"{part} {1000 * s / answered:.2f}" for part, s in cpu.items())
            + f"; all {1000 * sum(cpu.values()) / answered:.2f} ({sum(cpu.values()):.1f} s over {timed_s:.1f} s wall); "
            f"machine busy {busy_pct:.0f}% of {os.cpu_count()} cores; "
            f"{written[0]:.0f} reports written in {written[1]:.0f} transactions ({written[0] / max(1, written[1]):.1f} each)"
        )
        raw_s = raw_insert(engine, [ids[x] for x in names], gpus)
        raw_batch_s = raw_insert(engine, [ids[x] for x in names], gpus, per_txn=500)
        return {
            "HTTP reports/s (2xx, steady)": ok / timed_s,
            "HTTP warm-up reports/s (rows created)": warm_ok / warm_s,
            "HTTP p50 ms": statistics.median(lat) if lat else float("nan"),
            "HTTP p99 ms": pct(lat, 99) if lat else float("nan"),
            "HTTP non-2xx answers": float(bad + sum(warm_st.values()) - warm_ok),
            "CPU ms per report (all parts)": 1000 * sum(cpu.values()) / answered,
            "HTTP transport errors": float(sum(fails.values()) + sum(warm_f.values())),
            "raw insert, same rows, reports/s": n / raw_s,
            "raw insert, 500 reports a txn, reports/s": n / raw_batch_s,
        }
    finally:
        for child in children:
            if child.is_alive():
                child.terminate()
                child.join(timeout=10)
        if engine is not None:
            engine.dispose()
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def database(backend: str) -> Iterator[tuple[str, str]]:
    """A fresh database for one run: a new SQLite file, or a new PostgreSQL schema (dropped after)."""
    if backend == "sqlite":
        folder = tempfile.mkdtemp(prefix="bcm-bench-sqlite-")
        try:
            yield "SQLite", f"sqlite:///{folder}/bcm.db"
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    elif backend == "postgresql":
        schema = f"bench_{uuidlib.uuid4().hex[:10]}"
        admin = create_engine(PG_URL)
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        try:
            yield "PostgreSQL", f"{PG_URL}?options=-csearch_path%3D{schema}"
        finally:
            with admin.begin() as conn:
                conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
            admin.dispose()
    else:
        raise SystemExit(f"unknown backend {backend!r}")


def table(title: str, results: dict[str, dict[str, float]], goals: str) -> None:
    labels = list(next(iter(results.values())))
    print(f"\n{title}")
    print(f"{'':40}" + "".join(f"{b:>14}" for b in results))
    for label in labels:
        print(f"{label:40}" + "".join(f"{results[b][label]:>14.1f}" for b in results))
    print(goals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--mode", default="inproc,http", help="inproc, http or both (comma-separated)")
    ap.add_argument("--agents", type=int, default=50, help="http: concurrent agents")
    ap.add_argument("--reports", type=int, default=0, help="http: reports in the timed round (0: 3 x nodes)")
    ap.add_argument("--duration", type=float, default=60.0, help="http: bound on each round, seconds")
    ap.add_argument("--client-procs", type=int, default=1, help="http: client processes the agents share")
    ap.add_argument(
        "--server-env", action="append", default=[], metavar="BCM_X=V", help="http: extra server settings"
    )
    args = ap.parse_args()
    server_env = dict(kv.split("=", 1) for kv in args.server_env)
    if bad := [k for k in server_env if not k.startswith("BCM_")]:
        raise SystemExit(f"--server-env takes BCM_* settings only: {bad}")
    modes = args.mode.split(",")
    if unknown := set(modes) - {"inproc", "http"}:
        raise SystemExit(f"unknown mode {sorted(unknown)}")
    inproc: dict[str, dict[str, float]] = {}
    over_http: dict[str, dict[str, float]] = {}
    for backend in args.backends.split(","):
        if "inproc" in modes:
            with database(backend) as (label, url):
                inproc[label] = run(label, url, args.nodes, args.gpus, args.queries)
        if "http" in modes:
            with database(backend) as (label, url):
                over_http[label] = http_run(
                    label,
                    url,
                    args.nodes,
                    args.gpus,
                    args.agents,
                    args.reports or 3 * args.nodes,
                    args.duration,
                    args.client_procs,
                    server_env,
                )
    if inproc:
        table(
            f"GPU health, in-process: {args.nodes} nodes x {args.gpus} GPUs, one thread (one core)",
            inproc,
            "goals: >= 1000 node-reports/s on PostgreSQL (steady); summary p99 < 100 ms at 10k nodes",
        )
    if over_http:
        table(
            f"GPU health over HTTP (bcm serve): {args.nodes} nodes x {args.gpus} GPUs, {args.agents} agents "
            f"in {args.client_procs} client process(es), {os.cpu_count()} cores shared by server, database "
            "and clients" + (f"; server env {server_env}" if server_env else ""),
            over_http,
            "goals: PostgreSQL >= 1000 node-reports/s and p99 < 250 ms at 50 agents; SQLite >= 300/s, no errors",
        )


if __name__ == "__main__":
    main()
