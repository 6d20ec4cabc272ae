"""Server logging: libraries quiet unless debugging, bcm's own lines kept, script text never logged."""

from __future__ import annotations

import json
import subprocess
import sys

from bcm.logs import script_name

SCRIPT = "# bcm: start the bcm agent\nset -e\necho s3cret-marker\n"

EMIT = f"""
import logging, sys
from bcm import logs
print(logs.configure(*sys.argv[1:]))
logging.getLogger("asyncssh").info("[conn=0] Opening SSH connection to %s", "198.18.0.11")
logging.getLogger("asyncssh").info("[conn=0, chan=0]   Command: %s", {SCRIPT!r})
logging.getLogger("alembic.runtime.migration").info("Context impl SQLiteImpl.")
logging.getLogger("asyncssh").warning("[conn=0] Connection lost")
logging.getLogger("bcm.operations").info("operation 1 inventory started")
logging.getLogger("bcm.drivers.ssh").debug("ssh node01: ok in 0.1s")
try:
    raise RuntimeError("the database went away")
except RuntimeError:
    logging.getLogger("bcm.health").exception("health ingest of %d reports failed", 3)
logging.getLogger("bcm.api").warning("odd name %s", "gpu01\x1b[31m")
"""


def run(level: str, fmt: str = "text") -> tuple[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", EMIT, level, fmt], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout.strip(), done.stderr


def test_info_keeps_bcm_lines_and_library_warnings_only() -> None:
    uvicorn_level, log = run("info")
    assert uvicorn_level == "warning"
    assert "operation 1 inventory started" in log and "Connection lost" in log
    assert "Opening SSH connection" not in log and "Context impl" not in log
    assert "ssh node01" not in log and "s3cret-marker" not in log


def test_debug_shows_libraries_but_scripts_by_name_only() -> None:
    uvicorn_level, log = run("debug")
    assert uvicorn_level == "debug"
    assert "Opening SSH connection" in log and "ssh node01: ok" in log
    assert "Command: start the bcm agent" in log
    assert "s3cret-marker" not in log


def test_script_names() -> None:
    assert script_name(SCRIPT) == "start the bcm agent"
    assert script_name("true") == "true"
    assert script_name("scontrol update NodeName=n1 State=DRAIN") == "scontrol … (39 bytes)"
    assert script_name("") == "(empty)"


def test_json_lines_carry_time_level_logger_message_and_exception() -> None:
    uvicorn_level, log = run("info", "json")
    assert uvicorn_level == "warning"
    lines = log.splitlines()
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert len(records) == 4, log
    for r in records:
        assert {"time", "level", "logger", "message"} <= r.keys()
        assert r["time"].endswith("+00:00") and "T" in r["time"]
    by_message = {r["message"]: r for r in records}
    assert by_message["operation 1 inventory started"]["level"] == "INFO"
    assert by_message["operation 1 inventory started"]["logger"] == "bcm.operations"
    failed = by_message["health ingest of 3 reports failed"]
    assert failed["level"] == "ERROR"
    assert (
        "Traceback" in failed["exception"] and "RuntimeError: the database went away" in failed["exception"]
    )
    assert "\x1b" not in log  # a terminal escape stays an escape inside the JSON string
    assert by_message["odd name gpu01\x1b[31m"]["logger"] == "bcm.api"
    assert "Opening SSH connection" not in log and "s3cret-marker" not in log


def test_json_at_debug_keeps_scripts_by_name_only() -> None:
    _, log = run("debug", "json")
    messages = [json.loads(line)["message"] for line in log.splitlines()]
    assert "[conn=0, chan=0]   Command: start the bcm agent" in messages
    assert "s3cret-marker" not in log


def test_unknown_format_refused() -> None:
    import pytest
    from pydantic import ValidationError

    from bcm.settings import Settings

    assert Settings(log_format="JSON").log_format == "json"
    with pytest.raises(ValidationError, match="use text or json"):
        Settings(log_format="xml")
