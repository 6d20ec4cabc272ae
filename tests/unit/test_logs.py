"""Server logging: libraries quiet unless debugging, bcm's own lines kept, script text never logged."""

from __future__ import annotations

import subprocess
import sys

from bcm.logs import script_name

SCRIPT = "# bcm: start the bcm agent\nset -e\necho s3cret-marker\n"

EMIT = f"""
import logging, sys
from bcm import logs
print(logs.configure(sys.argv[1]))
logging.getLogger("asyncssh").info("[conn=0] Opening SSH connection to %s", "198.18.0.11")
logging.getLogger("asyncssh").info("[conn=0, chan=0]   Command: %s", {SCRIPT!r})
logging.getLogger("alembic.runtime.migration").info("Context impl SQLiteImpl.")
logging.getLogger("asyncssh").warning("[conn=0] Connection lost")
logging.getLogger("bcm.operations").info("operation 1 inventory started")
logging.getLogger("bcm.drivers.ssh").debug("ssh node01: ok in 0.1s")
"""


def run(level: str) -> tuple[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", EMIT, level], capture_output=True, text=True, timeout=60, check=True
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
