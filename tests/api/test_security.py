"""Attacks that once worked, each replayed as the role that found it, on SQLite and PostgreSQL.

Every attack must get its 4xx and leave the database byte-identical (snapshot before/after).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

from tests.api.test_auth import make_token
from tests.api.test_health_api import add_nodes, node_token, post, report, with_xid

TABLES = ("node", "interface", "category", "gpu", "gpuhealth", "healthrecord", "healthevent", "nodehealth")
ED25519 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
ED25519_B = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBG1QZ0pg8FOrXbZ9dUjGI9JtHqbJt6VTxvRWC+0qO3z"


def snapshot(engine: Engine) -> dict[str, list[Any]]:
    with engine.connect() as conn:
        return {t: sorted(map(repr, conn.execute(text(f"SELECT * FROM {t}")))) for t in TABLES}


def as_role(api: Any, role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {make_token(api, role)}"}


# --- 1. a hostlist must never run a command (ClusterShell's group upcalls) ----------------------------

INJECTIONS = ["@x$(touch {m})", "@x;touch {m};", "@x`touch {m}`", "@x|touch {m}", "n1,@x';touch {m};'"]


@pytest.mark.parametrize("pattern", INJECTIONS)
def test_hostlist_group_injection_runs_nothing(
    api: Any, engine: Engine, tmp_path: Path, pattern: str
) -> None:
    marker = tmp_path / "pwned"
    hostlist = pattern.format(m=marker)
    viewer = as_role(api, "viewer")
    add_nodes(api, engine, "n[1-2]")
    before = snapshot(engine)
    for method, path, kwargs in [
        ("GET", "/api/v1/nodes", {"params": {"nodes": hostlist}, "headers": viewer}),
        ("GET", "/api/v1/health/nodes", {"params": {"nodes": hostlist}, "headers": viewer}),
        ("GET", "/metrics", {"params": {"nodes": hostlist}, "headers": viewer}),
        ("DELETE", "/api/v1/nodes", {"params": {"nodes": hostlist}}),
        ("POST", "/api/v1/nodes/bulk", {"json": {"nodes": hostlist}}),
        ("POST", "/api/v1/nodes/actions/drain", {"json": {"nodes": hostlist}}),
    ]:
        r = api.request(method, path, **kwargs)
        assert r.status_code == 422, (path, r.text)
        assert r.json()["field"] == "nodes"
        # nothing of the server's internals comes back (no upcall command line, no venv path)
        assert "groups.conf" not in r.text and ".venv" not in r.text and "sed " not in r.text
    assert not marker.exists()
    assert snapshot(engine) == before


def test_hostlist_explosion_is_refused_before_expanding(api: Any, engine: Engine) -> None:
    viewer = as_role(api, "viewer")
    before = snapshot(engine)
    for hostlist in ("n[0-99999999]", "n[1-1000]-[1-1000]", "n[1-20000],m[1-2]"):
        r = api.get("/api/v1/nodes", params={"nodes": hostlist}, headers=viewer)
        assert r.status_code == 422 and "20000" in r.json()["message"], r.text
    assert snapshot(engine) == before


# --- 3. a category's health policy is typed ----------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "field"),
    [
        ({"temperature_margin_c": "hot"}, "health_policy.temperature_margin_c"),
        ({"ecc_uncorrected_max": 1.5}, "health_policy.ecc_uncorrected_max"),
        ({"pcie_check_generation": "yes"}, "health_policy.pcie_check_generation"),
        ({"xid_overrides": {"79": "FAIL"}}, "health_policy.xid_overrides.79"),
        ({"xid_overrides": {"x": {"severity": "FAIL", "action": "none"}}}, "health_policy.xid_overrides"),
        (
            {"xid_overrides": {"79": {"severity": "BAD", "action": "none"}}},
            "health_policy.xid_overrides.79.severity",
        ),
        ({"clock_events_warn": "hw_slowdown"}, "health_policy.clock_events_warn"),
        ({"clock_events_warn": ["melting"]}, "health_policy.clock_events_warn"),
        ({"stale_intervals": 0}, "health_policy.stale_intervals"),
        ({"surprise": 1}, "health_policy.surprise"),
    ],
)
def test_malformed_health_policy_is_refused_and_reports_keep_working(
    api: Any, engine: Engine, policy: dict[str, Any], field: str
) -> None:
    operator = as_role(api, "operator")
    add_nodes(api, engine, "gpu01")
    tok = node_token(api, "gpu01")
    assert api.patch("/api/v1/nodes/gpu01", json={"category": "gpu"}).status_code == 200
    before = snapshot(engine)
    r = api.patch("/api/v1/categories/gpu", json={"health_policy": policy}, headers=operator)
    assert r.status_code == 422 and r.json()["field"] == field, r.text
    r = api.post("/api/v1/categories", json={"name": "hp", "health_policy": policy}, headers=operator)
    assert r.status_code == 422 and r.json()["field"] == field, r.text
    assert snapshot(engine) == before
    assert post(api, tok, report("gpu01")).status_code == 202


def test_valid_policy_is_stored_as_given_and_a_legacy_bad_one_falls_back(api: Any, engine: Engine) -> None:
    policy = {"temperature_warn_c": 70, "xid_overrides": {"13": {"severity": "FAIL", "action": "reset_gpu"}}}
    r = api.patch("/api/v1/categories/gpu", json={"health_policy": policy})
    assert r.status_code == 200 and r.json()["health_policy"] == policy
    add_nodes(api, engine, "gpu01")
    api.patch("/api/v1/nodes/gpu01", json={"category": "gpu"})
    tok = node_token(api, "gpu01")
    # a policy written before policies were typed: reports are judged by the defaults, not refused
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE category SET health_policy = :p WHERE name = 'gpu'"),
            {"p": json.dumps({"temperature_margin_c": "hot"})},
        )
    assert post(api, tok, report("gpu01")).status_code == 202


# --- 4. what the schema accepts, the database stores ---------------------------------------------------


def _gpu0(rep: dict[str, Any], **changes: Any) -> dict[str, Any]:
    rep["gpus"][0].update(changes)
    return rep


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda r: _gpu0(r, memory_total_mib=2**31), "gpus.0.memory_total_mib"),
        (lambda r: _gpu0(r, memory_used_mib=2**40), "gpus.0.memory_used_mib"),
        (
            lambda r: _gpu0(r, ecc={**r["gpus"][0]["ecc"], "volatile_corrected": 2**63}),
            "gpus.0.ecc.volatile_corrected",
        ),
        (lambda r: _gpu0(r, name="G" * 129), "gpus.0.name"),
        (lambda r: _gpu0(r, uuid="GPU-" + "f" * 93), "gpus.0.uuid"),
        (lambda r: _gpu0(r, pci_bus_id="0" * 33), "gpus.0.pci_bus_id"),
        (lambda r: {**r, "agent_version": "v" * 65}, "agent_version"),
        (lambda r: {**r, "collected_at": "9999-12-31T23:59:59-14:00"}, "collected_at"),
        (lambda r: {**r, "collected_at": "0001-01-01T00:00:00Z"}, "collected_at"),
        (
            lambda r: {
                **with_xid(r),
                "xid_events": [{**with_xid(r)["xid_events"][0], "time": "9999-12-31T23:00:00-12:00"}],
            },
            "xid_events.0.time",
        ),
    ],
)
def test_report_values_beyond_the_columns_are_422(api: Any, engine: Engine, mutate: Any, field: str) -> None:
    add_nodes(api, engine, "gpu01")
    tok = node_token(api, "gpu01")
    assert post(api, tok, report("gpu01")).status_code == 202
    before = snapshot(engine)
    r = post(api, tok, mutate(report("gpu01")))
    assert r.status_code == 422, r.text
    assert r.json()["field"] == field, r.json()
    assert snapshot(engine) == before


def test_large_error_counters_are_stored(api: Any, engine: Engine) -> None:
    add_nodes(api, engine, "gpu01")
    tok = node_token(api, "gpu01")
    big = 2**40  # past INTEGER: a GPU whose counters grew large must still report
    rep = report("gpu01")
    g = rep["gpus"][0]
    g["ecc"] = {**g["ecc"], "volatile_corrected": big, "aggregate_corrected": big}
    g["pcie"] = {**g["pcie"], "replay_counter": big}
    assert post(api, tok, rep).status_code == 202
    gpus = api.get("/api/v1/nodes/gpu01/gpus").json()
    assert gpus[0]["ecc_sbe_volatile"] == big


# --- 5. a node writes only its own GPU history ------------------------------------------------------


def test_a_node_cannot_evict_another_nodes_gpu_history(api: Any, engine: Engine, settings: Any) -> None:
    settings.health.history_per_gpu = 10  # pruned every 10 reports
    add_nodes(api, engine, "gpu[01-02]")
    victim, attacker = node_token(api, "gpu01"), node_token(api, "gpu02")
    for _ in range(5):
        assert post(api, victim, report("gpu01")).status_code == 202
    uuid = report("gpu01")["gpus"][0]["uuid"]
    # gpu02 reports gpu01's GPU UUIDs, often enough to trigger pruning many times over
    for _ in range(30):
        assert post(api, attacker, report("gpu02")).status_code == 202
    with engine.connect() as conn:
        kept = conn.execute(
            text("SELECT count(*) FROM healthrecord r JOIN node n ON n.id = r.node_id WHERE n.name = 'gpu01'")
        ).scalar_one()
    assert kept == 5
    r = api.get(f"/api/v1/gpus/{uuid}/history")
    assert r.status_code == 409 and "gpu01" in r.json()["message"] and "gpu02" in r.json()["message"]
    r = api.get(f"/api/v1/gpus/{uuid}/history", params={"node": "gpu01"})
    assert r.status_code == 200 and r.json()["node"] == "gpu01" and len(r.json()["samples"]) == 5


# --- 6. pinned host keys change only through an audited admin verb ------------------------------------


def test_operator_cannot_clear_or_replace_a_pinned_host_key(api: Any, engine: Engine) -> None:
    operator = as_role(api, "operator")
    r = api.post(
        "/api/v1/nodes", json={"name": "pin1", "ip": "198.18.0.21", "ssh_host_key": ED25519 + " root@pin1"}
    )
    assert r.status_code == 201
    before = snapshot(engine)
    for value in (None, "garbage", ED25519_B):
        r = api.patch("/api/v1/nodes/pin1", json={"ssh_host_key": value}, headers=operator)
        assert r.status_code == 422 and r.json()["field"] == "ssh_host_key", r.text
        assert "rekey" in r.json()["message"]
    assert (
        api.post("/api/v1/nodes/pin1/rekey", json={"ssh_host_key": None}, headers=operator).status_code == 403
    )
    for bad in ("garbage", "ssh-ed25519 !!!", "ssh-rsa " + ED25519.split()[1], "ssh-dss AAAAB3NzaC1kc3M="):
        r = api.post("/api/v1/nodes/pin1/rekey", json={"ssh_host_key": bad})
        assert r.status_code == 422 and r.json()["field"] == "ssh_host_key", r.text
    r = api.post("/api/v1/nodes", json={"name": "pin2", "ssh_host_key": "ssh-ed25519 AAAA"})
    assert r.status_code == 422 and r.json()["field"] == "ssh_host_key"
    assert snapshot(engine) == before
    with engine.connect() as conn:
        assert conn.execute(text("SELECT ssh_host_key FROM node WHERE name='pin1'")).scalar_one() == ED25519


def test_admin_rekey_and_address_changes_are_audited_and_keep_the_pin(api: Any, engine: Engine) -> None:
    api.post("/api/v1/nodes", json={"name": "pin1", "ip": "198.18.0.21", "ssh_host_key": ED25519})
    assert api.patch("/api/v1/nodes/pin1", json={"interfaces": [{"ip": "198.18.0.99"}]}).status_code == 200
    with engine.connect() as conn:
        assert conn.execute(text("SELECT ssh_host_key FROM node WHERE name='pin1'")).scalar_one() == ED25519
    assert api.post("/api/v1/nodes/pin1/rekey", json={"ssh_host_key": ED25519_B}).status_code == 200
    assert api.post("/api/v1/nodes/pin1/rekey", json={"ssh_host_key": None}).status_code == 200
    events = {e["action"]: e for e in api.get("/api/v1/events", params={"target": "pin1"}).json()}
    assert "198.18.0.21 -> 198.18.0.99" in events["node.address"]["message"]
    assert "kept" in events["node.address"]["message"]
    assert events["node.rekey"]["actor"].startswith("admin:")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT ssh_host_key FROM node WHERE name='pin1'")).scalar_one() is None


# --- 7. the rest: names, roles, ranges, sizes, depth, control characters, guessing, retention ----------


@pytest.mark.parametrize(
    ("role", "method", "path", "kwargs", "status", "field"),
    [
        ("operator", "POST", "/api/v1/nodes", {"json": {"name": "abc\n"}}, 422, "name"),
        ("operator", "POST", "/api/v1/categories", {"json": {"name": "evil\n"}}, 422, "name"),
        ("operator", "POST", "/api/v1/nodes/bulk", {"json": {"nodes": "abc\n"}}, 422, "nodes"),
        ("operator", "DELETE", "/api/v1/nodes", {"params": {"nodes": "keep1"}}, 403, None),
        ("viewer", "GET", "/api/v1/nodes", {"params": {"offset": 2**40}}, 422, "offset"),
        ("viewer", "GET", "/api/v1/events", {"params": {"offset": 2**63}}, 422, "offset"),
        ("viewer", "GET", "/api/v1/operations/99999999999", {}, 422, "op_id"),
        ("admin", "DELETE", "/api/v1/tokens/99999999999999999999", {}, 422, "token_id"),
        # a filter time at the edge of the range is clamped to what the database stores (an answer, not a 500)
        ("viewer", "GET", "/api/v1/events", {"params": {"since": "9999-12-31T23:59:59-14:00"}}, 200, None),
        (
            "viewer",
            "GET",
            "/api/v1/health/events",
            {"params": {"since": "0001-01-01T00:00:00+14:00"}},
            200,
            None,
        ),
        ("viewer", "GET", "/api/v1/events", {"params": {"since": "1700000000"}}, 422, "since"),
        ("viewer", "GET", "/api/v1/health/events", {"params": {"since": "yesterday"}}, 422, "since"),
        (
            "operator",
            "POST",
            "/api/v1/nodes",
            {"json": {"name": "z1", "comment": "ok\x1b[31mred"}},
            422,
            "comment",
        ),
        (
            "admin",
            "POST",
            "/api/v1/tokens",
            {"json": {"name": "ci\x1b[2Jbot", "role": "viewer"}},
            422,
            "name",
        ),
        (
            "operator",
            "PATCH",
            "/api/v1/categories/gpu",
            {"json": {"description": "x\u009b31m"}},
            422,
            "description",
        ),
        (
            "operator",
            "PATCH",
            "/api/v1/categories/gpu",
            {"json": {"description": "x" * 2_000_000}},
            413,
            None,
        ),
        ("operator", "POST", "/api/v1/nodes", {"content": "[" * 500 + "]" * 500}, 400, "body"),
        (
            "viewer",
            "POST",
            "/api/v1/nodes",
            {
                "content": json.dumps(
                    {
                        "name": "z1",
                        "comment": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]],
                    }
                )
            },
            400,
            "body",
        ),
    ],
)
def test_small_holes(
    api: Any,
    engine: Engine,
    role: str,
    method: str,
    path: str,
    kwargs: dict[str, Any],
    status: int,
    field: str | None,
) -> None:
    api.post("/api/v1/nodes", json={"name": "keep1"})
    headers = {} if role == "admin" else as_role(api, role)
    if "content" in kwargs:
        headers["Content-Type"] = "application/json"
    before = snapshot(engine)
    r = api.request(method, path, headers=headers, **kwargs)
    assert r.status_code == status, r.text
    if field:
        assert r.json()["field"] == field, r.json()
    assert snapshot(engine) == before


def test_guessing_tokens_is_logged_without_the_token_and_braked(
    api: Any, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    guess = "bcm_" + "g" * 43
    limit = settings.http.auth_failures_per_minute
    with caplog.at_level(logging.WARNING, logger="bcm.api.auth"):
        codes = [
            api.get("/api/v1/nodes", headers={"Authorization": f"Bearer {guess}{i}"}).status_code
            for i in range(limit + 2)
        ]
    assert codes[:limit] == [401] * limit and codes[limit:] == [429, 429]
    r = api.get("/api/v1/nodes", headers={"Authorization": f"Bearer {guess}"})
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    # the token is verified first: the rightful holder behind the same address is never locked out
    assert api.get("/api/v1/nodes").status_code == 200
    # and a missing token is a 401 (a client not set up), not a guess
    assert api.get("/api/v1/nodes", headers={"Authorization": ""}).status_code == 401
    logged = [rec.getMessage() for rec in caplog.records if rec.name == "bcm.api.auth"]
    assert len(logged) == limit and all("authentication failed from" in m for m in logged)
    assert not any(guess in m for m in logged)


def test_guessing_node_tokens_on_the_report_route_is_braked_and_the_node_still_reports(
    api: Any, engine: Engine, settings: Any
) -> None:
    add_nodes(api, engine, "gpu01")
    tok = node_token(api, "gpu01")
    limit = settings.http.auth_failures_per_minute
    guesses = [post(api, f"bcm_{'n' * 43}{i}", report("gpu01")).status_code for i in range(limit + 2)]
    assert guesses[:limit] == [401] * limit and guesses[limit:] == [429, 429]
    assert post(api, tok, report("gpu01")).status_code == 202  # a valid node token from the same address


def test_health_events_are_pruned_per_node(api: Any, engine: Engine, settings: Any) -> None:
    settings.health.history_per_gpu = 10  # pruned every 10 reports
    settings.health.events_per_node = 7
    add_nodes(api, engine, "gpu01")
    tok = node_token(api, "gpu01")
    for i in range(40):  # each report with an Xid adds events
        assert post(api, tok, with_xid(report("gpu01"), xid=13 if i % 2 else 31)).status_code == 202
    with engine.connect() as conn:
        events = conn.execute(text("SELECT count(*) FROM healthevent")).scalar_one()
    # pruned to 7 at every 10th report; at most 9 reports' worth of events since the last prune
    assert 7 <= events <= 7 + 9 * 2


def test_rendered_text_never_reaches_ansible_as_a_template(tmp_path: Path) -> None:
    from bcm.drivers.ansible import AnsibleHost, run_playbook
    from bcm.errors import FatalDriverError

    with pytest.raises(FatalDriverError, match="bcm_slurm.files.slurm.conf"):
        run_playbook(
            "slurm.yml",
            [AnsibleHost("n1", "198.18.0.11", ED25519, ("slurm_nodes",))],
            {"bcm_slurm": {"files": {"slurm.conf": "ClusterName={{ lookup('pipe', 'id') }}"}}},
            key_file=tmp_path / "key",
            work_dir=tmp_path / "work",
        )
    assert not (tmp_path / "work").exists()
