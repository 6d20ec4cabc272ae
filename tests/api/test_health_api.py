"""GPU health through the HTTP API, on SQLite and PostgreSQL: agent reports in, verdicts, drains and queries out."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.engine import Engine
from sqlmodel import Session

from bcm.agent.collector import collect
from bcm.agent.fake_nvml import FakeNvml
from bcm.domain.health_report import MAX_REPORT_BYTES
from bcm.lab.fakegpu import RECORDED_NVML
from bcm.models.health import HealthEvent, HealthRecord

NVML = RECORDED_NVML
REPORT_URL = "/boot/v1/agent/report"


@pytest.fixture
def hapi(api: Any) -> Any:
    return api


def report(host: str, fixture: str = "h100_sxm_565.json", expected: int | None = None) -> dict[str, Any]:
    """A real collector report from a recorded fake NVML."""
    nv = FakeNvml.from_file(NVML / fixture)
    nv.init()
    try:
        return copy.deepcopy(dict(collect(nv, expected, hostname=host)))
    finally:
        nv.shutdown()


def with_xid(rep: dict[str, Any], xid: int = 79, gpu: int = 0) -> dict[str, Any]:
    out = copy.deepcopy(rep)
    g = out["gpus"][gpu]
    out["xid_events"] = [
        {
            "xid": xid,
            "gpu_index": gpu,
            "uuid": g["uuid"],
            "pci_bus_id": g["pci_bus_id"],
            "time": out["collected_at"],
            "source": "nvml",
            "message": None,
            "recovery_action": None,
        }
    ]
    return out


def add_nodes(hapi: Any, engine: Engine, hostlist: str, state: str = "ready") -> None:
    assert hapi.post("/api/v1/nodes/bulk", json={"nodes": hostlist}).status_code == 201
    # database before: the nodes are in service, as after a workload-manager deploy
    with engine.begin() as conn:
        conn.execute(text("UPDATE node SET provision_state = :s"), {"s": state})


def node_token(hapi: Any, name: str) -> str:
    r = hapi.post(f"/api/v1/nodes/{name}/token")
    assert r.status_code == 201, r.text
    return str(r.json()["token"])


def post(hapi: Any, token: str, body: Any) -> Any:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return hapi.post(
        REPORT_URL,
        content=data,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )


def state_of(hapi: Any, name: str) -> str:
    return str(hapi.get(f"/api/v1/nodes/{name}").json()["provision_state"])


def count(engine: Engine, model: Any) -> int:
    with Session(engine) as s:
        return int(s.execute(select(func.count()).select_from(model)).scalar_one())


def test_healthy_report_is_stored_and_summarised(hapi: Any, engine: Engine) -> None:
    add_nodes(hapi, engine, "gpu[01-03]")
    tok = node_token(hapi, "gpu01")
    r = post(hapi, tok, report("gpu01"))
    assert r.status_code == 202, r.text
    assert r.json() == {"node": "gpu01", "verdict": "OK", "report_verdict": "OK", "action": None}

    summary = hapi.get("/api/v1/health").json()
    assert summary["nodes"] == 3
    assert summary["nodes_by_verdict"] == {"OK": 1, "UNKNOWN": 2, "WARN": 0, "FAIL": 0}
    assert summary["nodes_never_reported"] == 2
    assert summary["gpus"] == 3 and summary["gpus_by_verdict"]["OK"] == 3

    gpus = hapi.get("/api/v1/nodes/gpu01/gpus").json()
    assert [g["index"] for g in gpus] == [0, 1, 2]
    assert gpus[0]["name"] == "NVIDIA H100 80GB HBM3" and gpus[0]["temperature_c"] == 30
    history = hapi.get(f"/api/v1/gpus/{gpus[0]['uuid']}/history").json()
    assert history["node"] == "gpu01" and len(history["samples"]) == 1
    assert hapi.get("/api/v1/gpus/GPU-nope/history").status_code == 404
    assert hapi.get("/api/v1/nodes/nope/gpus").status_code == 404

    unknown = hapi.get("/api/v1/health/nodes", params={"verdict": "unknown"}).json()
    assert [n["name"] for n in unknown["items"]] == ["gpu02", "gpu03"]
    assert hapi.get("/api/v1/health/nodes", params={"verdict": "sick"}).status_code == 422


def test_fail_drains_holds_and_resumes_after_n_healthy_reports(hapi: Any, engine: Engine) -> None:
    add_nodes(hapi, engine, "gpu01")
    tok = node_token(hapi, "gpu01")
    ok = report("gpu01")
    assert post(hapi, tok, ok).status_code == 202

    r = post(hapi, tok, with_xid(ok, 79))
    assert r.status_code == 202 and r.json()["verdict"] == "FAIL" and r.json()["action"] == "drain"
    assert state_of(hapi, "gpu01") == "drained"
    failing = hapi.get("/api/v1/health/nodes", params={"verdict": "fail"}).json()["items"]
    assert [n["name"] for n in failing] == ["gpu01"]
    reason = failing[0]["drain_reason"]
    uuid0 = ok["gpus"][0]["uuid"]
    assert reason.startswith(f"bcm: GPU 0 {uuid0} XID 79 ") and failing[0]["drained_by_bcm"]
    assert hapi.get("/api/v1/health").json()["failing"] == ["gpu01"]

    # the FAIL holds for resume_after_ok_intervals (3) healthy reports, then the node resumes
    for i in range(2):
        r = post(hapi, tok, ok).json()
        assert r["verdict"] == "FAIL" and r["report_verdict"] == "OK" and r["action"] is None, i
        assert state_of(hapi, "gpu01") == "drained"
        # the GPU keeps failing for the reason it failed, carried from report to report while it holds
        gpu0 = hapi.get("/api/v1/nodes/gpu01/gpus").json()[0]
        assert gpu0["verdict"] == "FAIL" and [x["code"] for x in gpu0["reasons"]][:2] == [
            "xid.79",
            "health.held",
        ], i
    r = post(hapi, tok, ok).json()
    assert r["verdict"] == "OK" and r["action"] == "resume"
    assert state_of(hapi, "gpu01") == "ready"

    codes = [e["code"] for e in hapi.get("/api/v1/health/events", params={"node": "gpu01"}).json()]
    for code in ("xid.79", "gpu.verdict", "node.verdict", "drain.requested", "drain.done", "resume.done"):
        assert code in codes
    gpu_events = hapi.get("/api/v1/health/events", params={"severity": "fail"}).json()
    assert all(e["severity"] == "FAIL" for e in gpu_events) and gpu_events


def test_admin_drain_is_left_alone(hapi: Any, engine: Engine) -> None:
    add_nodes(hapi, engine, "gpu[01-02]")
    verb = hapi.post("/api/v1/nodes/actions/drain", json={"nodes": "gpu01", "reason": "admin: fan"})
    assert verb.status_code == 200, verb.text
    tok = node_token(hapi, "gpu01")
    ok = report("gpu01")
    r = post(hapi, tok, with_xid(ok, 48)).json()
    assert r["verdict"] == "FAIL" and r["action"] is None
    for _ in range(4):
        post(hapi, tok, ok)
    assert state_of(hapi, "gpu01") == "drained"  # bcm never resumes a drain it did not make
    codes = [e["code"] for e in hapi.get("/api/v1/health/events").json()]
    assert "drain.skipped" in codes and "resume.requested" not in codes


def test_node_token_is_bound_to_its_node_and_reissue_revokes(hapi: Any, engine: Engine) -> None:
    add_nodes(hapi, engine, "gpu[01-02]")
    tok1 = node_token(hapi, "gpu01")
    assert post(hapi, tok1, report("gpu02")).status_code == 403  # another node's name
    assert post(hapi, tok1, report("gpu01.cluster.example")).status_code == 202  # FQDN of itself
    tok2 = node_token(hapi, "gpu01")
    assert post(hapi, tok1, report("gpu01")).status_code == 401  # the old token stopped working
    assert post(hapi, tok2, report("gpu01")).status_code == 202
    assert post(hapi, "bcm_nope", report("gpu01")).status_code == 401
    # an admin token is not a node token, and a node token reads nothing
    admin = hapi.headers["Authorization"].split()[1]
    assert post(hapi, admin, report("gpu01")).status_code == 403
    assert hapi.get("/api/v1/health", headers={"Authorization": f"Bearer {tok2}"}).status_code == 403


@pytest.mark.parametrize(
    "mutate",
    [
        lambda r: b"{not json",
        lambda r: {**r, "schema": 2},
        lambda r: {**r, "surprise": 1},
        lambda r: {**r, "gpus": [{**r["gpus"][0], "temperature_c": 9999}]},
        lambda r: {**r, "gpus": [{**r["gpus"][0], "index": -1}]},
        lambda r: {**r, "errors": ["x"] * 1000},
        lambda r: {k: v for k, v in r.items() if k != "gpus"},
        lambda r: json.dumps(r).encode() + b" " * MAX_REPORT_BYTES,
    ],
    ids=[
        "not-json",
        "schema",
        "extra-field",
        "temperature",
        "index",
        "too-many-errors",
        "no-gpus",
        "oversize",
    ],
)
def test_malformed_or_oversize_reports_are_422_and_store_nothing(
    hapi: Any, engine: Engine, mutate: Any
) -> None:
    add_nodes(hapi, engine, "gpu01")
    tok = node_token(hapi, "gpu01")
    body = mutate(report("gpu01"))
    r = post(hapi, tok, body)
    if isinstance(body, bytes) and len(body) > MAX_REPORT_BYTES:  # refused before parsing: 413
        assert r.status_code == 413 and r.json()["error"] == "PayloadTooLarge", r.text
    else:
        assert r.status_code == 422, r.text
        assert r.json()["error"] == "InvalidInput"
    assert count(engine, HealthRecord) == 0 and count(engine, HealthEvent) == 0
    assert hapi.get("/api/v1/health").json()["nodes_never_reported"] == 1


def test_report_streamed_past_the_cap_or_nested_deep_is_refused_and_stores_nothing(
    hapi: Any, engine: Engine
) -> None:
    """The report route reads and caps its own body (no Content-Length to trust when it is streamed) and
    leaves nesting to pydantic's parser: a 4xx naming the body, never a 5xx, and nothing stored."""
    add_nodes(hapi, engine, "gpu01")
    tok = node_token(hapi, "gpu01")
    headers = {"Authorization": f"Bearer {tok}", "Content-Type": "application/json"}

    def chunks() -> Any:
        for _ in range(MAX_REPORT_BYTES // 65536 + 2):
            yield b" " * 65536

    r = hapi.post(REPORT_URL, content=chunks(), headers=headers)
    assert r.status_code == 413 and r.json()["error"] == "PayloadTooLarge", r.text
    deep = json.dumps(report("gpu01"))[:-1] + ', "nested": ' + "[" * 5000 + "]" * 5000 + "}"  # past any limit
    r = post(hapi, tok, deep.encode())
    assert r.status_code == 422 and r.json()["field"] == "body", r.text
    assert count(engine, HealthRecord) == 0 and count(engine, HealthEvent) == 0


def test_missing_gpu_against_inventory_fails_node(hapi: Any, engine: Engine) -> None:
    add_nodes(hapi, engine, "gpu01")
    with engine.begin() as conn:  # database before: inventory found 4 GPUs
        node_id = conn.execute(text("SELECT id FROM node WHERE name = 'gpu01'")).scalar_one()
        conn.execute(text("UPDATE node SET inventoried_at = CURRENT_TIMESTAMP"))
        for i in range(4):
            conn.execute(
                text(
                    'INSERT INTO gpu (node_id, "index", uuid, updated_at) VALUES (:n, :i, :u, CURRENT_TIMESTAMP)'
                ),
                {"n": node_id, "i": i, "u": f"GPU-inv-{i}"},
            )
    tok = node_token(hapi, "gpu01")
    r = post(hapi, tok, report("gpu01", expected=3)).json()  # the agent was told 3; inventory says 4
    assert r["verdict"] == "FAIL" and r["action"] == "drain"
    node = hapi.get("/api/v1/health/nodes", params={"nodes": "gpu01"}).json()["items"][0]
    assert any(f["code"] == "gpu.count" for f in node["findings"])
    assert node["drain_reason"].startswith("bcm: gpu.count ")


def test_category_policy_changes_the_verdict(hapi: Any, engine: Engine) -> None:
    policy = {"xid_overrides": {"79": {"severity": "WARN", "action": "investigate"}}}
    assert (
        hapi.post("/api/v1/categories", json={"name": "lenient", "health_policy": policy}).status_code == 201
    )
    assert hapi.post("/api/v1/nodes/bulk", json={"nodes": "gpu01", "category": "lenient"}).status_code == 201
    tok = node_token(hapi, "gpu01")
    r = post(hapi, tok, with_xid(report("gpu01"), 79)).json()
    assert r["verdict"] == "WARN" and r["action"] is None


def test_history_is_bounded_per_gpu(hapi: Any, engine: Engine, settings: Any) -> None:
    settings.health.history_per_gpu = 10  # pruned every 10 reports, to 10 per GPU
    add_nodes(hapi, engine, "gpu01")
    tok = node_token(hapi, "gpu01")
    ok = report("gpu01")
    for _ in range(25):
        assert post(hapi, tok, ok).status_code == 202
    uuid0 = ok["gpus"][0]["uuid"]
    samples = hapi.get(f"/api/v1/gpus/{uuid0}/history", params={"limit": 1000}).json()["samples"]
    assert 10 <= len(samples) <= 15  # at most one pruning period over the bound
    assert 10 <= count(engine, HealthRecord) <= 15  # one row per report


def test_history_holds_each_gpus_own_readings(hapi: Any, engine: Engine, monkeypatch: Any) -> None:
    """A report's history row holds every GPU's reading; a GPU's history picks its own, newest first,
    skipping reports it was missing from, across pages of records."""
    from bcm.services import health_queries

    monkeypatch.setattr(health_queries, "CHUNK", 3)  # after a first page of `limit` records, three at a time
    add_nodes(hapi, engine, "gpu01")
    tok = node_token(hapi, "gpu01")
    base = report("gpu01")
    for i in range(6):
        rep = copy.deepcopy(base)
        for g in rep["gpus"]:
            g["temperature_c"] = 40 + i
        if i % 2:  # GPU 1 missing from every other report
            rep["gpus"] = [g for g in rep["gpus"] if g["index"] != 1]
        assert post(hapi, tok, rep).status_code == 202
    uuid0, uuid1 = base["gpus"][0]["uuid"], base["gpus"][1]["uuid"]

    def temps(uuid: str, **params: Any) -> list[int]:
        r = hapi.get(f"/api/v1/gpus/{uuid}/history", params={"node": "gpu01", **params})
        assert r.status_code == 200, r.text
        return [x["temperature_c"] for x in r.json()["samples"]]

    assert temps(uuid0) == [45, 44, 43, 42, 41, 40]
    assert temps(uuid1) == [44, 42, 40]
    assert temps(uuid1, limit=2) == [44, 42]
    assert count(engine, HealthRecord) == 6


def test_stale_sweep_marks_silent_nodes_unknown(hapi: Any, engine: Engine, settings: Any) -> None:
    from datetime import timedelta

    from bcm.db import session_scope
    from bcm.models.base import utcnow
    from bcm.services import health

    add_nodes(hapi, engine, "gpu[01-02]")
    for name in ("gpu01", "gpu02"):
        post(hapi, node_token(hapi, name), report(name))
    later = utcnow() + timedelta(seconds=settings.health.interval_s * settings.health.stale_intervals + 1)
    with session_scope(engine) as s:
        assert health.sweep_stale(s, settings.health, later) == ["gpu01", "gpu02"]
    with session_scope(engine) as s:
        assert health.sweep_stale(s, settings.health, later) == []  # once only
    summary = hapi.get("/api/v1/health").json()
    assert summary["nodes_by_verdict"]["UNKNOWN"] == 2
    codes = [e["code"] for e in hapi.get("/api/v1/health/events").json()]
    assert codes.count("report.stale") == 2


def test_metrics_need_a_viewer_token_and_use_dcgm_names(hapi: Any, engine: Engine) -> None:
    add_nodes(hapi, engine, "gpu[01-02]")
    tok = node_token(hapi, "gpu01")
    post(hapi, tok, with_xid(report("gpu01"), 79))
    body = hapi.get("/metrics").text
    uuid0 = report("gpu01")["gpus"][0]["uuid"]
    line = next(x for x in body.splitlines() if x.startswith("DCGM_FI_DEV_GPU_TEMP{") and uuid0 in x)
    assert 'gpu="0"' in line and 'Hostname="gpu01"' in line and 'modelName="NVIDIA H100 80GB HBM3"' in line
    assert line.endswith(" 30.0")
    for name in (
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_XID_ERRORS",
    ):
        assert f"# TYPE {name} gauge" in body
    xid = next(x for x in body.splitlines() if x.startswith("DCGM_FI_DEV_XID_ERRORS{") and uuid0 in x)
    assert xid.endswith(" 79.0")
    health = next(x for x in body.splitlines() if x.startswith("bcm_gpu_health{") and uuid0 in x)
    assert health.endswith(" 3.0")
    assert 'bcm_node_health{Hostname="gpu01"} 3.0' in body
    # the ingest's own counters: one report written, in one transaction, none waiting
    for series in (
        "bcm_health_ingest_reports_total 1.0",
        "bcm_health_ingest_batches_total 1.0",
        "bcm_health_ingest_waiting 0.0",
    ):
        assert series in body.splitlines(), series
    assert hapi.get("/metrics", headers={"Authorization": f"Bearer {tok}"}).status_code == 403
    assert hapi.get("/metrics", headers={"Authorization": ""}).status_code == 401
    only = hapi.get("/metrics", params={"nodes": "gpu02"}).text
    assert uuid0 not in only


def test_worker_carries_out_a_pending_drain_and_stops_when_asked(
    hapi: Any, engine: Engine, settings: Any
) -> None:
    import asyncio

    from bcm.workers.health import HealthWorker

    add_nodes(hapi, engine, "gpu01")
    assert post(hapi, node_token(hapi, "gpu01"), report("gpu01")).status_code == 202
    # database before: a drain decided but never carried out (the server stopped in between)
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE nodehealth SET pending_action = 'drain', drained_by_bcm = :t, drain_reason = 'bcm: x'"
            ),
            {"t": True},
        )
    worker = HealthWorker(engine, settings)

    async def go() -> None:
        await worker.run(passes=1)
        worker.start()  # the endless loop stops when asked
        await asyncio.sleep(0.05)
        await worker.stop()

    asyncio.run(go())
    assert state_of(hapi, "gpu01") == "drained"
    assert worker.task is None
    with engine.begin() as conn:
        assert conn.execute(text("SELECT pending_action FROM nodehealth")).scalar_one() is None
