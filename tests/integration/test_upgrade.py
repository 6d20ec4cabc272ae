"""Upgrades: a database written by an earlier bcm (schema OLD, with data in every table an admin cares
about) is upgraded in place by what `bcm serve` runs at start (bcm.server.prepare), and everything reads back
through the API: nodes and their interfaces, categories, users, tokens (which still authenticate), audit
events, operations, images, the Slurm cluster, GPU health, history and health events. Going back
(alembic downgrade, as the README says) keeps the data too. SQLite and PostgreSQL.

The rows are inserted with raw SQL written against OLD's schema, which never changes once released: only
the migrations after it, which this test exists to check, touch them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.script import ScriptDirectory
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from bcm.db import alembic_config
from bcm.services.auth import hash_token
from bcm.settings import Settings

# 0008_images: before the PXE tables, WLM members (0009), tenancy, the health write paths and per-report
# history rows (0011-0012), BMC binding, boot trust, audit, operation leases and HA (0013-0017)
OLD = "0008_images"
HEAD = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
# recent, as a live head node's rows are (older audit events would be pruned by the retention, 90 days)
T0 = (datetime.now(UTC) - timedelta(days=2)).replace(microsecond=0)
ADMIN = "bcm_" + "A" * 43  # tokens as bcm issues them: bcm_ + 43 url-safe characters
VIEWER = "bcm_" + "V" * 43
AGENT = "bcm_" + "N" * 43
FACTS = {"cpu": {"model": "AMD EPYC 9654", "sockets": 2, "cores": 192}, "memory_mib": 2_064_000}


def rows_at_old() -> list[tuple[str, list[dict[str, Any]] | dict[str, Any]]]:
    """(statement, parameters) for OLD's schema: a small but complete head node."""
    t = T0
    return [
        (
            "INSERT INTO users (id, name, role, full_name, created_at) VALUES (1, 'alice', 'operator', 'Alice A', :t)",
            {"t": t},
        ),
        (
            "INSERT INTO category (id, name, kernel_args, wlm_role, boot_mode, description, health_policy, created_at)"
            " VALUES (1, 'h100', 'quiet', 'compute', 'stateless', 'HGX H100 nodes', :policy, :t)",
            {"policy": json.dumps({"temperature_warn_c": 85}), "t": t},
        ),
        (
            "INSERT INTO node (id, name, category_id, provision_state, last_error, facts, comment, bmc_address,"
            " bmc_protocol, bmc_user, created_at, updated_at, inventoried_at)"
            " VALUES (:id, :name, 1, :state, :err, :facts, :comment, :bmc, 'ipmi', 'admin', :t, :t, :t)",
            [
                {
                    "id": 1,
                    "name": "gpu01",
                    "state": "ready",
                    "err": None,
                    "facts": json.dumps(FACTS),
                    "comment": "rack 4",
                    "bmc": "198.18.50.1",
                    "t": t,
                },
                {
                    "id": 2,
                    "name": "gpu02",
                    "state": "failed",
                    "err": "provision: timed out after 1800 s",
                    "facts": None,
                    "comment": None,
                    "bmc": "198.18.50.2",
                    "t": t,
                },
            ],
        ),
        (
            "INSERT INTO interface (id, node_id, name, mac, ip, boot) VALUES (:id, :n, 'eth0', :mac, :ip, :boot)",
            [
                {"id": 1, "n": 1, "mac": "52:54:00:aa:00:01", "ip": "198.18.100.11", "boot": True},
                {"id": 2, "n": 2, "mac": "52:54:00:aa:00:02", "ip": "198.18.100.12", "boot": True},
            ],
        ),
        (
            'INSERT INTO gpu (id, node_id, "index", uuid, name, memory_mib, pci_bus_id, verdict, updated_at)'
            " VALUES (:id, 1, :i, :uuid, 'NVIDIA H100 80GB HBM3', 81559, :bus, :v, :t)",
            [
                {"id": 1, "i": 0, "uuid": "GPU-old-0", "bus": "00000000:18:00.0", "v": "OK", "t": t},
                {"id": 2, "i": 1, "uuid": "GPU-old-1", "bus": "00000000:2A:00.0", "v": "FAIL", "t": t},
            ],
        ),
        (
            "INSERT INTO apitoken (id, name, role, token_hash, prefix, node_id, user_id, created_at)"
            " VALUES (:id, :name, :role, :hash, :prefix, :node, :user, :t)",
            [
                {
                    "id": 1,
                    "name": "bootstrap-admin",
                    "role": "admin",
                    "hash": hash_token(ADMIN),
                    "prefix": ADMIN[:10],
                    "node": None,
                    "user": None,
                    "t": t,
                },
                {
                    "id": 2,
                    "name": "alice-ro",
                    "role": "viewer",
                    "hash": hash_token(VIEWER),
                    "prefix": VIEWER[:10],
                    "node": None,
                    "user": 1,
                    "t": t,
                },
                {
                    "id": 3,
                    "name": "agent-gpu01",
                    "role": "node",
                    "hash": hash_token(AGENT),
                    "prefix": AGENT[:10],
                    "node": 1,
                    "user": None,
                    "t": t,
                },
            ],
        ),
        (
            "INSERT INTO event (id, time, actor, action, target, severity, message, detail)"
            " VALUES (1, :t, 'token:1 bootstrap-admin', 'node.add', 'gpu[01-02]', 'info', 'registered 2 node(s)', :d)",
            {"t": t, "d": json.dumps({"count": 2})},
        ),
        (
            "INSERT INTO operation (id, kind, targets, state, progress_done, progress_total, created_by, error,"
            " results, log, created_at, started_at, finished_at)"
            " VALUES (:id, :kind, 'gpu[01-02]', :state, 2, 2, 'token:1 bootstrap-admin', :err, :res, :log, :t, :t, :t)",
            [
                {
                    "id": 1,
                    "kind": "inventory",
                    "state": "succeeded",
                    "err": None,
                    "log": "2 ok\n",
                    "t": t,
                    "res": json.dumps({"gpu01": {"status": "ok"}, "gpu02": {"status": "ok"}}),
                },
                {
                    "id": 2,
                    "kind": "provision",
                    "state": "failed",
                    "err": "1 of 2 nodes failed",
                    "log": "",
                    "t": t,
                    "res": json.dumps(
                        {"gpu01": {"status": "ok"}, "gpu02": {"status": "failed", "error": "timed out"}}
                    ),
                },
            ],
        ),
        (
            "INSERT INTO image (id, name, version, state, recipe, driver_version, cuda_version, kernel_version,"
            " is_current, created_at, published_at) VALUES (1, 'gpu-base', '20260601-1', 'ready', 'gpu-base',"
            " '565.57.01', '12.7', '6.1.0-21-amd64', :yes, :t, :t)",
            {"yes": True, "t": t},
        ),
        (
            "INSERT INTO imageartifact (id, image_id, kind, filename, size, sha256)"
            " VALUES (1, 1, 'kernel', 'vmlinuz', 8123456, :sha)",
            {"sha": "ab" * 32},
        ),
        (
            "INSERT INTO wlm_cluster (id, name, kind, controller_id, nodes, settings, state, created_at, updated_at,"
            " deployed_at) VALUES (1, 'slurm', 'slurm', 1, 'gpu[01-02]', :s, 'ready', :t, :t, :t)",
            {"s": json.dumps({}), "t": t},
        ),
        (
            "INSERT INTO nodehealth (node_id, verdict, report_verdict, last_report_at, collected_at, consecutive_ok,"
            " gpu_count, agent_version, driver_version, findings, drained_by_bcm, drain_reason, action_attempts,"
            " samples_since_prune, updated_at) VALUES (1, 'FAIL', 'FAIL', :t, :t, 0, 2, '0.1.0', '565.57.01', :f,"
            " :yes, 'bcm: GPU 1 Xid 79', 0, 4, :t)",
            {"t": t + timedelta(seconds=30), "f": json.dumps([]), "yes": True},
        ),
        (
            'INSERT INTO gpuhealth (node_id, "index", uuid, name, verdict, temperature_c, power_draw_w, xid_count,'
            " last_xid, sampled_at) VALUES (1, :i, :uuid, 'NVIDIA H100 80GB HBM3', :v, :temp, 350.5, :n, :xid, :t)",
            [
                {
                    "i": 0,
                    "uuid": "GPU-old-0",
                    "v": "OK",
                    "temp": 41,
                    "n": 0,
                    "xid": None,
                    "t": t + timedelta(seconds=30),
                },
                {
                    "i": 1,
                    "uuid": "GPU-old-1",
                    "v": "FAIL",
                    "temp": 44,
                    "n": 1,
                    "xid": 79,
                    "t": t + timedelta(seconds=30),
                },
            ],
        ),
        (
            "INSERT INTO healthsample (node_id, uuid, gpu_index, time, verdict, temperature_c, power_draw_w, xid)"
            " VALUES (1, :uuid, :i, :t, :v, :temp, 350.5, :xid)",
            [
                {
                    "uuid": f"GPU-old-{i}",
                    "i": i,
                    "t": t + timedelta(seconds=30 * k),
                    "v": "FAIL" if (i, k) == (1, 1) else "OK",
                    "temp": 40 + i + k,
                    "xid": 79 if (i, k) == (1, 1) else None,
                }
                for k in range(2)
                for i in range(2)
            ],
        ),
        (
            "INSERT INTO healthevent (id, time, node_id, gpu_uuid, gpu_index, severity, code, message, action)"
            " VALUES (1, :t, 1, 'GPU-old-1', 1, 'critical', 'xid_79', 'GPU has fallen off the bus', 'drain')",
            {"t": t + timedelta(seconds=30)},
        ),
    ]


def old_database(url: str) -> None:
    """OLD's schema by its own migrations, and the rows an admin of that release had."""
    command.upgrade(alembic_config(url), OLD)
    engine = create_engine(url)
    with engine.begin() as conn:
        for statement, params in rows_at_old():
            conn.execute(text(statement), params)
        if engine.dialect.name == "postgresql":  # explicit ids: move the sequences past them, as use would
            for table in (
                "users",
                "category",
                "node",
                "interface",
                "gpu",
                "apitoken",
                "event",
                "operation",
                "image",
                "imageartifact",
                "wlm_cluster",
                "healthevent",
                "healthsample",
            ):
                conn.execute(text(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), 100)"))
    engine.dispose()


def revision(url: str) -> str | None:
    engine = create_engine(url)
    with engine.connect() as conn:
        current = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    engine.dispose()
    return current


@pytest.fixture
def upgraded(tmp_path: Path, db_url: str) -> Iterator[tuple[TestClient, Engine, Settings]]:
    from bcm.api.app import create_app
    from bcm.server import prepare

    old_database(db_url)
    assert revision(db_url) == OLD
    settings = Settings(state_dir=tmp_path / "state", database_url=db_url, health={"ingest_processes": 0})
    engine, token_file = prepare(settings)  # what `bcm serve` runs at start: the upgrade in place
    assert token_file is None  # the old admin token still counts: no second bootstrap token
    assert revision(db_url) == HEAD
    with TestClient(create_app(settings, engine)) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN}"
        yield client, engine, settings
    engine.dispose()


def report_of(hostname: str) -> dict[str, Any]:
    """An agent's report for a recorded H100 board."""
    from bcm.agent.collector import collect
    from bcm.agent.fake_nvml import FakeNvml
    from bcm.lab.fakegpu import RECORDED_NVML

    nv = FakeNvml.from_file(RECORDED_NVML / "h100_sxm_565.json")
    nv.init()
    try:
        return json.loads(json.dumps(dict(collect(nv, None, hostname=hostname)), default=str))
    finally:
        nv.shutdown()


def ok(r: Any) -> Any:
    assert r.status_code == 200, r.text
    return r.json()


def test_everything_reads_back_after_the_upgrade(upgraded: tuple[TestClient, Engine, Settings]) -> None:
    api, _engine, _settings = upgraded
    nodes = {n["name"]: n for n in ok(api.get("/api/v1/nodes"))["items"]}
    assert set(nodes) == {"gpu01", "gpu02"}
    assert nodes["gpu01"]["provision_state"] == "ready" and nodes["gpu02"]["provision_state"] == "failed"
    assert nodes["gpu02"]["last_error"] == "provision: timed out after 1800 s"
    assert [(i["mac"], i["ip"]) for i in nodes["gpu01"]["interfaces"]] == [
        ("52:54:00:aa:00:01", "198.18.100.11")
    ]
    gpu01 = ok(api.get("/api/v1/nodes/gpu01"))
    assert (
        gpu01["category"] == "h100" and gpu01["comment"] == "rack 4" and gpu01["bmc_address"] == "198.18.50.1"
    )
    hardware = ok(api.get("/api/v1/nodes/gpu01/hardware"))
    assert hardware["facts"] == FACTS and {g["uuid"] for g in hardware["gpus"]} == {"GPU-old-0", "GPU-old-1"}
    category = ok(api.get("/api/v1/categories/h100"))
    assert category["kernel_args"] == "quiet" and category["health_policy"]["temperature_warn_c"] == 85
    assert [u["name"] for u in ok(api.get("/api/v1/users"))] == ["alice"]
    tokens = {t["name"]: t for t in ok(api.get("/api/v1/tokens"))}
    assert (tokens["alice-ro"]["role"], tokens["alice-ro"]["user"]) == ("viewer", "alice")
    assert any(
        e["action"] == "node.add" and e["message"] == "registered 2 node(s)"
        for e in ok(api.get("/api/v1/events"))
    )
    ops = {o["id"]: o for o in ok(api.get("/api/v1/operations"))}
    assert (ops[1]["kind"], ops[1]["state"]) == ("inventory", "succeeded")
    assert (ops[2]["state"], ops[2]["error"]) == ("failed", "1 of 2 nodes failed")
    assert ok(api.get("/api/v1/operations/2"))["results"]["gpu02"]["error"] == "timed out"
    images = ok(api.get("/api/v1/images"))
    assert [(i["name"], i["version"], i["state"]) for i in images] == [("gpu-base", "20260601-1", "ready")]
    clusters = ok(api.get("/api/v1/wlm"))
    assert [(c["name"], c["kind"]) for c in clusters] == [("slurm", "slurm")]
    slurm = ok(api.get("/api/v1/wlm/slurm"))  # 0009_wlm_members made member rows of the hostlist
    assert (slurm["controller"], [m["name"] for m in slurm["members"]]) == ("gpu01", ["gpu01", "gpu02"])
    # GPU health: the verdicts, the history rewritten by 0012, the events
    gpus = {g["uuid"]: g for g in ok(api.get("/api/v1/nodes/gpu01/gpus"))}
    assert gpus["GPU-old-1"]["verdict"] == "FAIL" and gpus["GPU-old-0"]["temperature_c"] == 41
    history = ok(api.get("/api/v1/gpus/GPU-old-1/history"))
    temps = sorted(s["temperature_c"] for s in history["samples"])
    assert temps == [41, 42], history
    events = ok(api.get("/api/v1/health/events"))
    assert any(e["code"] == "xid_79" and e["node"] == "gpu01" for e in events), events
    summary = ok(api.get("/api/v1/health"))
    assert summary["failing"] == ["gpu01"] and summary["nodes_drained_by_bcm"] == 1
    scraped = api.get("/metrics").text.splitlines()
    assert 'bcm_nodes{state="failed"} 1.0' in scraped and 'bcm_operations{state="failed"} 1.0' in scraped


def test_old_tokens_still_work(upgraded: tuple[TestClient, Engine, Settings]) -> None:
    api, _engine, _settings = upgraded
    viewer = {"Authorization": f"Bearer {VIEWER}"}
    assert api.get("/api/v1/nodes", headers=viewer).status_code == 200
    assert api.post("/api/v1/nodes", json={"name": "x1"}, headers=viewer).status_code == 403
    agent = {"Authorization": f"Bearer {AGENT}"}
    assert api.get("/api/v1/nodes", headers=agent).status_code == 403  # a node token stays a node token
    r = api.post("/boot/v1/agent/report", json=report_of("gpu01"), headers=agent)
    assert r.status_code == 202, r.text
    # and new work goes on: a node added after the upgrade, next to the old ones
    assert api.post("/api/v1/nodes", json={"name": "gpu03"}).status_code == 201
    assert [n["name"] for n in ok(api.get("/api/v1/nodes"))["items"]] == ["gpu01", "gpu02", "gpu03"]


def test_going_back_keeps_the_data(upgraded: tuple[TestClient, Engine, Settings]) -> None:
    """The README's way back: `alembic downgrade` to the old release's revision (run by the new bcm, which
    has the downgrade steps), then the old release starts on it; upgrading again works."""
    _api, engine, settings = upgraded
    url = settings.effective_database_url
    engine.dispose()
    command.downgrade(alembic_config(url), OLD)
    assert revision(url) == OLD
    check = create_engine(url)
    with check.connect() as conn:
        assert conn.execute(text("SELECT name, provision_state FROM node ORDER BY name")).all() == [
            ("gpu01", "ready"),
            ("gpu02", "failed"),
        ]
        assert conn.execute(text("SELECT count(*) FROM apitoken")).scalar() == 3
        assert conn.execute(text("SELECT count(*) FROM healthsample WHERE node_id = 1")).scalar() == 4
    check.dispose()
    command.upgrade(alembic_config(url), "head")
    assert revision(url) == HEAD
