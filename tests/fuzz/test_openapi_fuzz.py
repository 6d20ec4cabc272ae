"""schemathesis against the live OpenAPI of a real `bcm serve` (SQLite and PostgreSQL), every check on.

Bounded: a fixed number of examples per operation and a time budget. Operations that would reach out
over SSH, to BMCs or to Debian mirrors (trust, inventory/provision verbs, agent and Slurm deploys, power
actions, image builds) are left out: lab tests cover them against real sshd, Slurm, BMC emulators, mmdebstrap.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bcm.devserver import Server
from tests.conftest import pg_schema

pytestmark = pytest.mark.integration

SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"
CONFIG = Path(__file__).with_name("schemathesis.toml")
# operations that reach other machines (SSH, BMCs, Debian mirrors) or start background work against them
EXCLUDED = r"^/api/v1/(nodes/(trust|actions/.*)|agents/deploy|images/(build|[^/]+/push)|wlm/(slurm/deploy|actions/.*|[^/]+/(verify|sync)))$"


@pytest.fixture(params=["sqlite", "postgresql"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Server]:
    env = {"BCM_HTTP__AUTH_FAILURES_PER_MINUTE": "100000", "BCM_POWER__POLL_INTERVAL_S": "0"}
    if request.param == "sqlite":
        srv = Server(tmp_path / "state", extra_env=env)
        srv.start()
        yield srv
        srv.stop()
        return
    with pg_schema() as url:
        srv = Server(tmp_path / "state", database_url=url, extra_env=env)
        srv.start()
        yield srv
        srv.stop()


def test_no_server_errors_and_every_answer_documented(server: Server, tmp_path: Path) -> None:
    if not SCHEMATHESIS.exists():
        pytest.fail("schemathesis is not installed (it is in the test extras)")
    seeded = server.cli("node", "add", "gpu[01-04]", "--mac", "52:54:00:00:00:01", "--ip", "198.18.0.11")
    assert seeded.returncode == 0, seeded.stderr
    cmd = [
        str(SCHEMATHESIS),
        "--config-file",
        str(CONFIG),
        "run",
        f"{server.url}/openapi.json",
        "--checks",
        "all",
        "--max-examples",
        "15",
        "--max-time",
        "240",
        "--request-timeout",
        "30",
        "--seed",
        "8470",
        "--generation-deterministic",
        "--workers",
        "1",
        "--exclude-path-regex",
        EXCLUDED,
        "-H",
        f"Authorization: Bearer {server.token()}",
        "--no-color",
        "--report",
        "junit",
        "--report-dir",
        str(tmp_path / "report"),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    log = run.stdout[-12000:] + run.stderr[-2000:]
    assert run.returncode == 0, log
    server_log = server.log.read_text() if server.log else ""
    assert "Traceback" not in server_log, server_log[-6000:]
