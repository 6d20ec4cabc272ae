"""Monitoring the monitor: docs/prometheus/bcm-rules.yml passes Debian's promtool (check and unit tests),
every metric the rules and docs/grafana/bcm.json name is one that a real `bcm serve` exports on /metrics,
and a real Prometheus scrapes bcm on loopback with a viewer token and loads the rules."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bcm.devserver import REPO, Server, free_port
from bcm.lab.fakegpu import RECORDED_NVML

RULES = REPO / "docs" / "prometheus" / "bcm-rules.yml"
RULE_TESTS = REPO / "tests" / "data" / "prometheus" / "bcm-rules.test.yml"
DASHBOARD = REPO / "docs" / "grafana" / "bcm.json"
# series Prometheus makes itself for every target, not bcm's
SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
PROMQL_WORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "inf",
    "nan",
}


def tool(name: str) -> str:
    """promtool and prometheus from Debian's prometheus package (scripts/test-all installs it)."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is missing: apt-get install prometheus (scripts/test-all installs it)")
    return path


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions, keywords, label
    names (inside {…} or a by/without/on/ignoring list), durations or strings."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values, regexes)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges and subqueries
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for m in re.finditer(r"(?<![\w.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", expr):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in PROMQL_WORDS or re.fullmatch(r"\d+[smhdwy]", word):
            continue
        names.add(word)
    return names


def test_metric_names_of_promql() -> None:
    """The extractor itself, on the shapes the rules and the dashboard use."""
    assert metric_names('max by (Hostname, gpu) (bcm_gpu_health{Hostname=~"$node"}) == 3') == {
        "bcm_gpu_health"
    }
    assert metric_names("sum by (instance) (rate(bcm_a_total[5m])) / sum(rate(bcm_b_total[5m]))") == {
        "bcm_a_total",
        "bcm_b_total",
    }
    assert metric_names('time() - max(x_seconds) > 600 or vector(0) and on(job) up{job="bcm"}') == {
        "x_seconds",
        "up",
    }


def rule_exprs() -> dict[str, str]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    for var in doc["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["query"]["query"])
            assert m, var
            exprs.append(m.group(1))
    return exprs


@pytest.fixture(scope="module")
def bcm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real `bcm serve` with a node whose agent reported its GPUs, so every GPU series has samples."""
    from bcm.agent.collector import collect
    from bcm.agent.fake_nvml import FakeNvml

    srv = Server(tmp_path_factory.mktemp("bcm") / "state")
    srv.start()
    try:
        assert srv.cli("node", "add", "gpu01").returncode == 0
        token = srv.cli("node", "token", "gpu01").stdout.strip().splitlines()[-1]
        nv = FakeNvml.from_file(RECORDED_NVML / "h100_sxm_565.json")
        nv.init()
        report = copy.deepcopy(dict(collect(nv, None, hostname="gpu01")))
        nv.shutdown()
        r = httpx.post(
            f"{srv.url}/boot/v1/agent/report",
            json=report,
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )
        assert r.status_code == 202, r.text
        yield srv
    finally:
        srv.stop()


def exported(srv: Server) -> set[str]:
    r = httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {srv.token()}"}, timeout=30)
    assert r.status_code == 200, r.text
    return {s.name for family in text_string_to_metric_families(r.text) for s in family.samples}


def gpu_series(srv: Server, name: str) -> int:
    r = httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {srv.token()}"}, timeout=30)
    return sum(1 for f in text_string_to_metric_families(r.text) for s in f.samples if s.name == name)


def test_promtool_checks_the_rules() -> None:
    done = subprocess.run(
        [tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rule_exprs())} rules found" in done.stdout


def test_promtool_unit_tests_fire_the_alerts(tmp_path: Path) -> None:
    done = subprocess.run(
        [tool("promtool"), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    tested = {
        t["alertname"]
        for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for t in case["alert_rule_test"]
    }
    assert {
        "BcmNodesFailed",
        "BcmGpuFailing",
        "BcmHealthIngestBehind",
        "BcmDnsmasqRestarting",
        "BcmOperationsFailing",
    } <= tested
    # the unit tests can fail: a GPU rule that no longer fires on FAIL is caught
    rules = tmp_path / "docs" / "prometheus"
    rules.mkdir(parents=True)
    (rules / RULES.name).write_text(
        RULES.read_text().replace("(bcm_gpu_health) == 3", "(bcm_gpu_health) == 4")
    )
    tests = tmp_path / "tests" / "data" / "prometheus"
    tests.mkdir(parents=True)
    shutil.copy(RULE_TESTS, tests / RULE_TESTS.name)
    broken = subprocess.run(
        [tool("promtool"), "test", "rules", str(tests / RULE_TESTS.name)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert broken.returncode != 0 and "BcmGpuFailing" in broken.stdout + broken.stderr


def test_every_metric_named_is_exported(bcm_server: Server) -> None:
    names = exported(bcm_server)
    assert "DCGM_FI_DEV_GPU_TEMP" in names and "bcm_health_ingest_reports_total" in names  # data came through
    for alert, expr in rule_exprs().items():
        missing = metric_names(expr) - names - SYNTHETIC
        assert not missing, f"alert {alert} names metrics /metrics does not export: {sorted(missing)}"
    for expr in dashboard_exprs():
        missing = metric_names(expr) - names - SYNTHETIC
        assert not missing, (
            f"dashboard query {expr!r} names metrics /metrics does not export: {sorted(missing)}"
        )


def test_dashboard_layout() -> None:
    doc = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for p in doc["panels"]:
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}"  # the data source is picked at import
    assert [v["name"] for v in doc["templating"]["list"]] == ["datasource", "node"]


def test_state_counts_are_exported(bcm_server: Server) -> None:
    r = httpx.get(
        f"{bcm_server.url}/metrics", headers={"Authorization": f"Bearer {bcm_server.token()}"}, timeout=30
    )
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(r.text)
        for s in f.samples
    }
    assert samples[("bcm_nodes", (("state", "registered"),))] == 1
    assert samples[("bcm_nodes", (("state", "failed"),))] == 0
    assert samples[("bcm_operations", (("state", "failed"),))] == 0
    assert samples[("bcm_health_ingest_capacity", ())] == 5000
    assert samples[("bcm_health_ingest_refused_total", ())] == 0
    assert samples[("bcm_dnsmasq_running", ())] == 0  # PXE off
    assert samples[("bcm_dnsmasq_restarts_total", ())] == 0


def test_a_real_prometheus_scrapes_bcm(bcm_server: Server, tmp_path: Path) -> None:
    """Prometheus on 127.0.0.1 scrapes bcm (loopback) with a viewer token from a file, and loads the rules."""
    viewer = bcm_server.cli("token", "create", "prometheus", "--role", "viewer")
    assert viewer.returncode == 0, viewer.stderr
    token = next(w for w in viewer.stdout.split() if w.startswith("bcm_"))
    credentials = tmp_path / "bcm.token"
    credentials.write_text(token + "\n")
    credentials.chmod(0o600)
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(RULES)],
                "scrape_configs": [
                    {
                        "job_name": "bcm",
                        "authorization": {"credentials_file": str(credentials)},
                        "static_configs": [{"targets": [f"127.0.0.1:{bcm_server.port}"]}],
                    }
                ],
            }
        )
    )
    log = tmp_path / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                tool("prometheus"),
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--web.console.templates=/nonexistent",
                "--web.console.libraries=/nonexistent",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        up = query_until(api, 'up{job="bcm"} == 1', proc, log)
        assert up[0]["metric"]["instance"] == f"127.0.0.1:{bcm_server.port}"
        nodes = query_until(api, 'bcm_nodes{job="bcm", state="registered"}', proc, log)
        assert nodes[0]["value"][1] == "1"
        temps = query_until(api, 'DCGM_FI_DEV_GPU_TEMP{Hostname="gpu01"}', proc, log)
        assert len(temps) == gpu_series(bcm_server, "DCGM_FI_DEV_GPU_TEMP") > 0  # one per GPU reported
        for expr in dashboard_exprs():  # every dashboard query parses and runs ($node: every node)
            r = httpx.get(f"{api}/query", params={"query": expr.replace("$node", ".*")}, timeout=10)
            assert r.status_code == 200 and r.json()["status"] == "success", (expr, r.text)
        rules = httpx.get(f"{api}/rules", timeout=5).json()["data"]["groups"]
        assert {r["name"] for g in rules for r in g["rules"]} == set(rule_exprs())
        assert all(r["health"] != "err" for g in rules for r in g["rules"]), rules
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def query_until(
    api: str, promql: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60
) -> list:  # type: ignore[type-arg]
    """Ask Prometheus's HTTP API until ``promql`` has a result (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            r = httpx.get(f"{api}/query", params={"query": promql}, timeout=5)
            result = r.json()["data"]["result"] if r.status_code == 200 else []
        except httpx.HTTPError:
            result = []
        if result:
            return list(result)
        time.sleep(0.5)
    pytest.fail(f"prometheus: no result for {promql} within {timeout_s:.0f}s: {log.read_text()[-2000:]}")
