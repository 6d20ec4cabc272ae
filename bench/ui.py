"""Benchmark: the dashboard's pages at 10,000 nodes × 8 GPUs, and the bytes of a first load.

Seeds a SQLite database (``--database-url`` for an empty PostgreSQL database instead): the nodes registered and in service, eight inventoried GPUs each, one real
collector report per node through the health ingest (1% of them with an XID 79, so some GPUs fail),
``--history`` more reports for one node (its charts), a few operations, a Slurm cluster of every node with
ten departments of ten projects and a tenants' sample (each node running one project's 8-GPU job, every
fourth shared with a second project's 1-GPU job) stored the way the sync stores it (timed). Then starts a real ``bcm serve``
on 127.0.0.1, signs in with a viewer token through the sign-in form, and asks each page ``--requests``
times on one keep-alive connection. Prints per page the server's own time (its ``Server-Timing``
header: dependencies, queries, rendering) p50/p99, the client's wall time p99 and the page's size; then
what a first load transfers (the page and every asset it names, as a browser with an empty cache fetches them).

Goals (printed, never asserted): a 100-row Nodes page and the Overview p99 < 150 ms; a first load < 300 KB.
Usage: .venv/bin/python bench/ui.py [--nodes 10000] [--gpus 8] [--requests 100] [--history 1000]
    [--database-url postgresql+psycopg://bcm@db/bcm_bench]
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
import time
from pathlib import Path

import httpx
from common import pct
from health import bodies, template
from sqlalchemy import insert, text

from bcm.db import session_scope
from bcm.devserver import Server
from bcm.domain.health_report import HealthReport
from bcm.drivers.wlm import slurm_usage
from bcm.models.auth import Role
from bcm.models.base import utcnow
from bcm.models.gpu import Gpu
from bcm.models.node import NodeBulkCreate
from bcm.models.operation import Operation, OpState
from bcm.models.tenancy import Department, Project
from bcm.models.wlm import WlmCluster, WlmMember
from bcm.server import prepare
from bcm.services import auth, health, nodes, wlm_usage
from bcm.settings import Settings

PAGES = [
    ("Overview", "/ui/", True),
    ("Nodes, 100 rows", "/ui/nodes", True),
    ("Nodes, 100 rows, page 50", "/ui/nodes?offset=5000", True),
    ("Nodes, sorted by GPU health", "/ui/nodes?sort=health&dir=desc", False),
    ("Nodes, sorted by GPUs", "/ui/nodes?sort=gpus", False),
    ("Nodes, hostlist of 1,000", "/ui/nodes?nodes=gpu[02001-03000]", False),
    ("Nodes, health FAIL", "/ui/nodes?health=FAIL", False),
    ("Nodes, 500 rows", "/ui/nodes?limit=500", False),
    ("Node (8 GPUs, charts)", "/ui/nodes/gpu00001", False),
    ("Health", "/ui/health", False),
    ("Operations", "/ui/operations", False),
    ("Images", "/ui/images", False),
    ("Workload managers", "/ui/wlm", False),
    ("Tenancy", "/ui/tenancy", False),
    ("PXE", "/ui/pxe", False),
]


def seed(url: str, state: Path, n: int, gpus: int, history: int) -> str:
    """A database of ``n`` nodes in service with ``gpus`` GPUs each, reported once; a viewer token."""
    settings = Settings(state_dir=state, database_url=url)
    engine, _ = prepare(settings)
    names = [f"gpu{i:05d}" for i in range(1, n + 1)]
    t0 = time.perf_counter()
    with session_scope(engine) as s:
        nodes.bulk_create(s, NodeBulkCreate(nodes=f"gpu[00001-{n:05d}]", category="gpu"), "bench")
    with engine.begin() as conn:
        conn.execute(text("UPDATE node SET provision_state = 'ready', power_state = 'on'"))
        ids = {str(name): int(i) for name, i in conn.execute(text("SELECT name, id FROM node"))}
    payloads = bodies(names, template(gpus))
    reports = [HealthReport.model_validate_json(b) for b in payloads]
    now = utcnow()
    with engine.begin() as conn:
        rows = [
            {
                "node_id": ids[name],
                "index": g["index"],
                "uuid": g.get("uuid"),
                "name": g.get("name"),
                "memory_mib": 81559,
                "updated_at": now,
            }
            for name, rep in zip(names, reports, strict=True)
            for g in rep.gpus
        ]
        for k in range(0, len(rows), 5000):
            conn.execute(insert(Gpu), rows[k : k + 5000])
    for i, name in enumerate(names):
        if i % 100 == 7:  # 1%: GPU 0 fell off the bus
            raw = reports[i].model_dump(mode="json")
            g0 = raw["gpus"][0]
            raw["xid_events"] = [
                {
                    "xid": 79,
                    "gpu_index": 0,
                    "uuid": g0["uuid"],
                    "pci_bus_id": g0["pci_bus_id"],
                    "time": raw["collected_at"],
                    "source": "nvml",
                    "message": None,
                    "recovery_action": None,
                }
            ]
            reports[i] = HealthReport.model_validate(raw)
    for k in range(0, n, 500):
        with session_scope(engine) as s:
            health.ingest_many(
                s, [(ids[names[j]], reports[j]) for j in range(k, min(n, k + 500))], settings.health
            )
    first = reports[0].model_dump(mode="json")
    for h in range(history):
        for g in first["gpus"]:
            g["temperature_c"] = 40 + (h * 7 + g["index"] * 3) % 30
            g["power_draw_w"] = 300.0 + (h * 13 + g["index"]) % 200
        with session_scope(engine) as s:
            health.ingest(s, ids[names[0]], HealthReport.model_validate(first), settings.health)
    with session_scope(engine) as s:
        for k in range(30):  # finished inventories of 100 nodes each, as the Operations page lists them
            names_k = [f"gpu{k * 100 + j:05d}" for j in range(1, 101)]
            s.add(
                Operation(
                    kind="inventory",
                    targets=f"gpu[{k * 100 + 1:05d}-{k * 100 + 100:05d}]",
                    state=OpState.SUCCEEDED.value,
                    progress_done=100,
                    progress_total=100,
                    created_by="bench",
                    results={x: {"status": "ok"} for x in names_k},
                    log="".join(f"{x}: ok\n" for x in names_k),
                    started_at=now,
                    finished_at=now,
                )
            )
        _row, secret = auth.issue(s, "bench-viewer", Role.VIEWER)
    with session_scope(engine) as s:
        cluster = WlmCluster(name="bench", kind="slurm", controller_id=ids[names[0]], state="deployed")
        s.add(cluster)
        s.flush()
        s.add_all([WlmMember(cluster_id=cluster.id or 0, node_id=ids[x]) for x in names])
        for d in range(10):
            dept = Department(name=f"dept{d}", gpu_quota=n * gpus // 10)
            s.add(dept)
            s.flush()
            s.add_all(
                [
                    Project(
                        name=f"proj{d}{p}",
                        department_id=dept.id or 0,
                        deserved_gpus=n * gpus // 100,
                        limit_gpus=n * gpus // 50,
                    )
                    for p in range(10)
                ]
            )
    squeue = "".join(
        f"{i}|proj{i % 100:02d}|{x}|cpu=32,mem=256G,node=1,billing=32,gres/gpu={gpus}|N/A|N/A\n"
        for i, x in enumerate(names)
    )
    squeue += "".join(
        f"{n + i}|proj{(i + 1) % 100:02d}|{x}|cpu=1,node=1,billing=1,gres/gpu=1|N/A|N/A\n"
        for i, x in enumerate(names)
        if i % 4 == 0
    )
    for _ in range(2):  # the first sample writes every row, the next only what changed (nothing)
        t1 = time.perf_counter()
        with session_scope(engine) as s:
            wlm_usage.apply(s, "bench", slurm_usage.parse_running(squeue))
        print(f"  a sync's tenants sample of {n} nodes parsed and stored in {time.perf_counter() - t1:.2f} s")
    engine.dispose()
    print(
        f"  seeded {n} nodes × {gpus} GPUs, {history} more reports for {names[0]} in {time.perf_counter() - t0:.1f} s"
    )
    return secret


def sign_in(client: httpx.Client, token: str) -> None:
    form = client.get("/ui/signin").text
    csrf = re.search(r'name="csrf" value="([^"]+)"', form).group(1)  # type: ignore[union-attr]
    r = client.post("/ui/signin", data={"csrf": csrf, "token": token, "next": "/ui/"})
    assert r.status_code == 303 and "bcm_session" in client.cookies, r.text


def first_load(url: str, token: str, path: str) -> tuple[int, int]:
    """Bytes and requests of one page and every asset it names, with an empty cache (no compression)."""
    with httpx.Client(base_url=url, timeout=60) as c:
        sign_in(c, token)
        page = c.get(path)
        total, count = len(page.content), 1
        for asset in sorted(set(re.findall(r'(?:href|src)="(/ui/static/[^"]+)"', page.text))):
            total += len(c.get(asset).content)
            count += 1
    return total, count


def run(label: str, url: str, args: argparse.Namespace) -> None:
    state = Path(tempfile.mkdtemp(prefix="bcm-bench-ui-"))
    try:
        token = seed(url, state, args.nodes, args.gpus, args.history)
        server = Server(state, database_url=url)
        server.start()
        try:
            with httpx.Client(base_url=server.url, timeout=60) as c:
                sign_in(c, token)
                print(
                    f"\n[{label}] {args.nodes:,} nodes × {args.gpus} GPUs, {args.requests} requests per page "
                    "(server: its Server-Timing; wall: as this client saw it)"
                )
                print(
                    f"  {'page':32} {'server p50':>10} {'server p99':>10} {'wall p99':>9} {'bytes':>9}  goal"
                )
                for name, path, goal in PAGES:
                    for _ in range(3):  # warm-up: caches, the first connection
                        c.get(path)
                    server_ms: list[float] = []
                    wall_ms: list[float] = []
                    size = 0
                    for _ in range(args.requests if goal else max(10, args.requests // 5)):
                        t0 = time.perf_counter()
                        r = c.get(path)
                        wall_ms.append((time.perf_counter() - t0) * 1000)
                        assert r.status_code == 200, (path, r.status_code, r.text[-500:])
                        server_ms.append(float(r.headers["server-timing"].split("dur=")[1]))
                        size = len(r.content)
                    p99 = pct(server_ms, 99)
                    verdict = ("met" if p99 < 150 else "MISSED") if goal else ""
                    print(
                        f"  {name:32} {pct(server_ms, 50):8.1f}ms {p99:8.1f}ms {pct(wall_ms, 99):7.1f}ms "
                        f"{size:>9,}  {'p99 < 150 ms: ' + verdict if goal else ''}"
                    )
            for path in ("/ui/nodes", "/ui/"):
                total, count = first_load(server.url, token, path)
                print(
                    f"  first load of {path}: {total / 1024:.1f} KB in {count} requests "
                    f"(goal < 300 KB: {'met' if total < 300 * 1024 else 'MISSED'})"
                )
        finally:
            server.stop()
    finally:
        shutil.rmtree(state, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--history", type=int, default=1000)
    parser.add_argument(
        "--database-url", default="", help="an empty database (default: SQLite in a temp dir)"
    )
    args = parser.parse_args()
    run("PostgreSQL" if args.database_url.startswith("postgresql") else "SQLite", args.database_url, args)


if __name__ == "__main__":
    main()
