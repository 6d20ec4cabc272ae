"""The agent's reporter and loop against a real stdlib HTTP server on 127.0.0.1 started by each test."""

from __future__ import annotations

import http.server
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bcm.agent import schema
from bcm.agent.collector import XidWatcher, collect
from bcm.agent.fake_nvml import FakeNvml
from bcm.agent.main import Agent
from bcm.agent.reporter import REPORT_PATH, AgentConfig, ConfigError, Reporter
from bcm.domain.health import Verdict, evaluate
from bcm.lab.fakegpu import RECORDED_NVML

DATA = RECORDED_NVML
TOKEN = "node-token-123"


class Receiver:
    """A report endpoint on 127.0.0.1: bound at once (so its URL is known) but refusing until :meth:`up`."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.statuses: list[int] = []  # answers to give, in order; 202 once exhausted
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.requests.append(
                    {
                        "path": self.path,
                        "auth": self.headers.get("Authorization"),
                        "type": self.headers.get("Content-Type"),
                        "body": json.loads(body),
                    }
                )
                self.send_response(receiver.statuses.pop(0) if receiver.statuses else 202)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler, bind_and_activate=False)
        self.httpd.server_bind()  # bound but not listening: connections are refused, as from a down server
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread: threading.Thread | None = None

    def up(self) -> None:
        self.httpd.server_activate()
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.thread is not None:
            self.httpd.shutdown()
            self.thread.join(timeout=10)
        self.httpd.server_close()

    def bodies(self) -> list[dict[str, Any]]:
        return [r["body"] for r in self.requests]


@pytest.fixture
def server() -> Iterator[Receiver]:
    receiver = Receiver()
    try:
        yield receiver
    finally:
        receiver.close()


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, step: float = 0.0) -> None:
        self.now = 100.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def report(n: int) -> schema.Report:
    nv = FakeNvml.from_file(DATA / "h100_sxm_565.json")
    nv.init()
    return collect(nv, 3, hostname=f"gpu{n:02d}", now=1_731_567_600.0 + n)


def hostnames(bodies: list[dict[str, Any]]) -> list[str]:
    return [b["hostname"] for b in bodies]


def test_report_arrives_with_token_and_json(server: Receiver) -> None:
    server.up()
    reporter = Reporter(server.url, TOKEN, timeout_s=10)
    assert reporter.submit(report(1)) == 1
    (request,) = server.requests
    assert request["path"] == REPORT_PATH
    assert request["auth"] == f"Bearer {TOKEN}"
    assert request["type"] == "application/json"
    assert request["body"] == json.loads(json.dumps(report(1)))
    assert (reporter.sent, len(reporter.buffer)) == (1, 0)


def test_down_then_up_delivers_buffered_reports_oldest_first(server: Receiver) -> None:
    clock = Clock()
    reporter = Reporter(server.url, TOKEN, buffer_max=10, timeout_s=10, monotonic=clock)
    for n in (1, 2, 3):
        assert reporter.submit(report(n)) == 0
        clock.now += 60  # past any backoff: every submit really tries the dead server
    assert len(reporter.buffer) == 3 and reporter.sent == 0
    assert reporter.last_error is not None and "unreachable" in reporter.last_error
    server.up()
    assert reporter.flush() == 3
    assert hostnames(server.bodies()) == ["gpu01", "gpu02", "gpu03"]
    assert len(reporter.buffer) == 0


def test_full_buffer_drops_the_oldest(server: Receiver) -> None:
    clock = Clock()
    reporter = Reporter(server.url, TOKEN, buffer_max=3, timeout_s=10, monotonic=clock)
    for n in range(1, 6):
        reporter.submit(report(n))
        clock.now += 60
    assert reporter.dropped == 2
    server.up()
    reporter.flush()
    assert hostnames(server.bodies()) == ["gpu03", "gpu04", "gpu05"]


def test_backoff_holds_retries_until_it_expires(server: Receiver) -> None:
    server.up()
    server.statuses = [503, 503]
    clock = Clock()
    reporter = Reporter(server.url, TOKEN, timeout_s=10, monotonic=clock, backoff_max_s=30)
    reporter.submit(report(1))  # 503: kept, retry after 1 s
    assert len(server.requests) == 1 and len(reporter.buffer) == 1
    reporter.submit(report(2))  # inside the backoff: queued without a request
    assert len(server.requests) == 1
    clock.now += 1.0
    assert reporter.flush() == 0  # second 503: retry after 2 s
    assert len(server.requests) == 2
    clock.now += 1.0
    assert reporter.flush() == 0 and len(server.requests) == 2
    clock.now += 1.0
    assert reporter.flush() == 2
    assert hostnames(server.bodies()) == ["gpu01", "gpu01", "gpu01", "gpu02"]


def test_refused_reports_are_dropped_not_retried(server: Receiver) -> None:
    server.up()
    server.statuses = [422]
    reporter = Reporter(server.url, TOKEN, timeout_s=10, monotonic=Clock())
    assert reporter.submit(report(1)) == 0
    assert (reporter.rejected, len(reporter.buffer)) == (1, 0)
    assert reporter.last_error is not None and "422" in reporter.last_error
    assert reporter.submit(report(2)) == 1
    assert hostnames(server.bodies()) == ["gpu01", "gpu02"]


@pytest.mark.parametrize("status", [401, 403, 404, 413])
def test_other_client_errors_are_not_retried(server: Receiver, status: int) -> None:
    server.up()
    server.statuses = [status]
    reporter = Reporter(server.url, TOKEN, timeout_s=10, monotonic=Clock())
    reporter.submit(report(1))
    assert reporter.rejected == 1 and not reporter.buffer


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503])
def test_transient_statuses_keep_the_report(server: Receiver, status: int) -> None:
    server.up()
    server.statuses = [status]
    reporter = Reporter(server.url, TOKEN, timeout_s=10, monotonic=Clock())
    reporter.submit(report(1))
    assert reporter.rejected == 0 and len(reporter.buffer) == 1


def test_oversize_report_is_not_sent(server: Receiver) -> None:
    server.up()
    reporter = Reporter(server.url, TOKEN, timeout_s=10)
    huge = dict(report(1), errors=["x" * (schema.MAX_REPORT_BYTES + 1)])
    reporter.submit(huge)  # type: ignore[arg-type]
    assert reporter.rejected == 1 and server.requests == []


# --- the agent loop ---------------------------------------------------------------------------------


def config(server: Receiver, **fields: Any) -> AgentConfig:
    return AgentConfig.from_dict({"server_url": server.url, "token": TOKEN, "expected_gpus": 3, **fields})


def test_agent_reports_on_its_interval(server: Receiver) -> None:
    server.up()
    nv = FakeNvml.from_file(DATA / "h100_sxm_565.json")
    cfg = config(server, interval_s=30)
    clock = Clock(step=5.0)  # every look at the clock is 5 s later
    agent = Agent(cfg, nv, Reporter(server.url, TOKEN, timeout_s=10), monotonic=clock, hostname="gpu01")
    agent.watcher = XidWatcher(nv, use_kmsg=False, sleep=lambda s: None)
    try:
        assert agent.run(max_reports=3) == 3
    finally:
        agent.close()
    bodies = server.bodies()
    assert len(bodies) == 3 and all(b["xid_events"] == [] for b in bodies)
    assert all(evaluate(b).verdict == Verdict.OK for b in bodies)
    assert nv.initialized is False  # close() shut NVML down


def test_agent_reports_at_once_on_an_xid(server: Receiver) -> None:
    server.up()
    nv = FakeNvml.from_file(DATA / "h100_sxm_565.json")
    nv.push_xid(79, 1)
    clock = Clock(step=0.0)  # time stands still: only the event can trigger the second report
    agent = Agent(config(server), nv, Reporter(server.url, TOKEN, timeout_s=10), monotonic=clock)
    agent.watcher = XidWatcher(nv, use_kmsg=False, sleep=lambda s: None)
    try:
        assert agent.run(max_reports=2) == 2
    finally:
        agent.close()
    first, second = server.bodies()
    assert first["xid_events"] == []
    assert [(e["xid"], e["gpu_index"], e["uuid"]) for e in second["xid_events"]] == [
        (79, 1, "GPU-7c3cadbd-17e5-0913-f69b-c618122ea0cd")
    ]
    assert evaluate(second).verdict == Verdict.FAIL


def test_agent_reports_that_nvml_cannot_start(server: Receiver) -> None:
    server.up()
    data = json.loads((DATA / "h100_sxm_565.json").read_text())
    nv = FakeNvml(dict(data, init_error="DRIVER_NOT_LOADED"))
    agent = Agent(
        config(server, expected_gpus=8), nv, Reporter(server.url, TOKEN, timeout_s=10), monotonic=Clock(10)
    )
    try:
        agent.run(max_reports=1)
    finally:
        agent.close()
    (body,) = server.bodies()
    assert body["gpu_count"] == 0 and body["errors"] == ["NVML init failed: DRIVER_NOT_LOADED"]
    node = evaluate(body)
    assert node.verdict == Verdict.FAIL
    assert [f.code for f in node.findings] == ["gpu.count", "nvml.unavailable"]


# --- configuration ----------------------------------------------------------------------------------


def write_config(tmp_path: Path, data: Any, mode: int = 0o600) -> Path:
    path = tmp_path / "agent.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    os.chmod(path, mode)
    return path


def test_config_loads_from_a_private_file(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        {"server_url": "http://198.18.0.1:8470/", "token": TOKEN, "expected_gpus": 8, "buffer_max": 5},
    )
    cfg = AgentConfig.load(path)
    assert (cfg.server_url, cfg.token, cfg.interval_s, cfg.expected_gpus, cfg.buffer_max) == (
        "http://198.18.0.1:8470",
        TOKEN,
        30.0,
        8,
        5,
    )
    assert TOKEN not in repr(cfg)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o666])
def test_config_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = write_config(tmp_path, {"server_url": "http://127.0.0.1:1", "token": TOKEN}, mode)
    with pytest.raises(ConfigError, match="chmod 600"):
        AgentConfig.load(path)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("{not json", "not valid JSON"),
        ([], "JSON object"),
        ({"server_url": "http://127.0.0.1:1"}, "token"),
        ({"server_url": "ftp://x", "token": "t"}, "http"),
        ({"server_url": "http://127.0.0.1:1", "token": "t", "interval": 5}, "unknown keys"),
        ({"server_url": "http://127.0.0.1:1", "token": "t", "interval_s": 0}, "must be > 0"),
        ({"server_url": "http://127.0.0.1:1", "token": "t", "buffer_max": "many"}, "invalid literal"),
        ({"server_url": "https://127.0.0.1:1", "token": "t", "ca_file": ""}, "ca_file"),
        ({"server_url": "https://127.0.0.1:1", "token": "t", "ca_file": 7}, "ca_file"),
    ],
)
def test_bad_config_is_refused_with_a_reason(tmp_path: Path, data: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AgentConfig.load(write_config(tmp_path, data))


def test_config_names_the_ca_an_https_server_is_verified_against(tmp_path: Path) -> None:
    data = {"server_url": "https://198.18.0.1:8470", "token": TOKEN, "ca_file": "/etc/bcm/ca.pem"}
    assert AgentConfig.load(write_config(tmp_path, data)).ca_file == "/etc/bcm/ca.pem"
    assert AgentConfig.from_dict({"server_url": "https://198.18.0.1:8470", "token": TOKEN}).ca_file is None


def test_missing_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        AgentConfig.load(tmp_path / "absent.json")
