"""README.md as a new user follows it: every ``sh`` block, line by line, verbatim and in order.

The first command makes a fresh virtualenv (``pip install -e .``, no test extras) in a copy of the
source tree; the state directory is fresh. Only the port (``8470`` in the text, ``BCM_PORT`` in the
environment) and the state directory (``BCM_STATE_DIR``) differ from what a user gets. Two lines are
not run as they stand: a line ending in ``&`` starts in the background, as a user leaves the server
running, and the test waits until it listens; ``scripts/test-all`` is the suite this test belongs to.
A command fails the test when it exits non-zero or prints an error.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from bcm.devserver import free_port
from bcm.lab import Lab

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOC_PORT = "8470"
ERROR = re.compile(r"^\s*(error:|Traceback \(most recent call last\))", re.IGNORECASE | re.MULTILINE)
COMMAND_TIMEOUT_S = 1200


def sh_lines(text: str, runner: str | None = None) -> list[str]:
    """Command lines of the ```sh blocks, in order (blank lines and whole-line comments dropped).

    A block right under ``<!-- run verbatim by tests/…/x.py … -->`` is another test's to run (that test
    checks what the flow did, beyond exit codes): ``runner`` names it; None takes every other block."""
    lines: list[str] = []
    pattern = r"(?:^<!-- run verbatim by ([\w./-]+)[^\n]*-->\n)?^```sh\n(.*?)^```"
    for owner, block in re.findall(pattern, text, re.MULTILINE | re.DOTALL):
        if (owner or None) != runner:
            continue
        lines += [ln for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return lines


def copy_tree(dest: Path) -> None:
    """The source tree as a new user's checkout has it: no virtualenv, no build leftovers."""
    shutil.copytree(
        REPO,
        dest,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            "__pycache__",
            "*.egg-info",
            ".mypy_cache",
            ".ruff_cache",
            ".pytest_cache",
            "build",
        ),
    )


def wait_listening(port: int, server: subprocess.Popen[bytes], log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:  # bounded by timeout_s
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if server.poll() is not None:
            pytest.fail(f"the server exited ({server.returncode}):\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"the server did not listen on {port} within {timeout_s:.0f}s")
        time.sleep(0.5)


def test_sh_lines_are_found_in_order() -> None:
    text = "intro\n```sh\n# comment\na --x  # note\n\nb\n```\n```python\nc\n```\n```sh\nd &\n```\n"
    assert sh_lines(text) == ["a --x  # note", "b", "d &"]
    owned = (
        text + "<!-- run verbatim by tests/lab/x.py, which checks more -->\n```sh\ne\n```\n```sh\nf\n```\n"
    )
    assert sh_lines(owned) == ["a --x  # note", "b", "d &", "f"]
    assert sh_lines(owned, "tests/lab/x.py") == ["e"]
    assert sh_lines(README.read_text(), "tests/lab/test_zero_touch.py"), (
        "the zero-touch flow is run by its test"
    )


@pytest.mark.timeout(3600)  # the flows boot two TCG VMs over PXE, among the rest
def test_readme_flows_work_as_written(lab_required: None, tmp_path: Path) -> None:
    lines = sh_lines(README.read_text())
    assert lines and "pip install" in lines[0], "README's first command must be the install"
    work = tmp_path / "bcm"
    copy_tree(work)
    port = free_port()
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BCM_", "VIRTUAL_ENV"))}
    env |= {"BCM_PORT": str(port), "BCM_STATE_DIR": str(state), "COLUMNS": "200"}
    env["PATH"] = ":".join(p for p in env.get("PATH", "").split(":") if not p.startswith(str(REPO)))
    background: list[subprocess.Popen[bytes]] = []
    transcript: list[str] = []
    try:
        for line in lines:
            command = line.replace(DOC_PORT, str(port))
            if "scripts/test-all" in command:
                continue  # the test suite itself
            if command.rstrip().endswith("&"):
                log = tmp_path / f"background-{len(background)}.log"
                with open(log, "wb") as out:
                    proc = subprocess.Popen(
                        ["bash", "-c", "exec " + command.rstrip().rstrip("&")],
                        cwd=work,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                background.append(proc)
                wait_listening(port, proc, log)
                transcript.append(f"$ {line}\n(started in the background)")
                continue
            done = subprocess.run(
                ["bash", "-o", "pipefail", "-c", command],
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
                check=False,
            )
            output = done.stdout + done.stderr
            transcript.append(f"$ {line}\n{output[-3000:]}")
            if done.returncode != 0 or ERROR.search(output):
                pytest.fail(
                    f"README command failed (exit {done.returncode}): {line}\n\n" + "\n".join(transcript[-4:])
                )
        assert any("lab down" in line for line in lines), "README's lab flow must end with bcm lab down"
    finally:
        (tmp_path / "transcript.txt").write_text("\n".join(transcript) + "\n")
        for proc in background:
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # its own session: the server and nothing else
                proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        leftover = Lab(state / "lab" / "bcmlab", "bcmlab")
        if leftover.is_up():
            leftover.down()
