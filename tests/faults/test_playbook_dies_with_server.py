"""A server killed with SIGKILL takes its running ansible-playbook with it (#27).

Otherwise the dead server's playbook runs on while the server that takes its operation up runs the
deploy again on the same nodes (two package installs at once, two restarts of the daemons). A real
ansible-playbook through bcm's driver (ansible-runner), in a process that stands for the server and runs
it from a worker thread as the server does; the playbook's one task is a local ``sleep``. Every wait is
bounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bcm.lab import procs

SERVER = """
import sys, threading
from pathlib import Path
from bcm.drivers import ansible
work = Path(sys.argv[1])
def go():
    ansible.run_playbook("sleep.yml", [], {}, key_file=work / "none", work_dir=work / "ansible", timeout_s=300)
t = threading.Thread(target=go)
t.start()
t.join()
"""


def playbooks_under(work: Path) -> list[int]:
    found = []
    for pid in procs.all_pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            cwd = os.readlink(f"/proc/{pid}/cwd")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"ansible-playbook" in argv and cwd.startswith(str(work)) and state not in ("Z", "X"):
            found.append(pid)
    return found


def task_runs(work: Path) -> bool:
    """The playbook's ``sleep`` task is running (a ``sleep 300`` under an ansible-playbook of ``work``)."""
    parents = set(playbooks_under(work))
    for pid in procs.all_pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if argv == b"sleep\x00300\x00" and any(p in parents for p in _ancestors(pid)):
            return True
    return False


def _ancestors(pid: int) -> list[int]:
    out = []
    for _ in range(16):  # bounded
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        out.append(pid)
    return out


def test_a_killed_server_leaves_no_playbook_running(tmp_path: Path) -> None:
    playbooks = tmp_path / "playbooks"
    (playbooks / "roles").mkdir(parents=True)
    (playbooks / "sleep.yml").write_text(
        "- hosts: localhost\n  connection: local\n  gather_facts: false\n  tasks:\n    - command: sleep 300\n"
    )
    env = {**os.environ, "BCM_ANSIBLE_DIR": str(playbooks)}
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(tmp_path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        running: list[int] = []
        while not (running and task_runs(tmp_path)) and time.monotonic() < deadline:  # bounded
            assert server.poll() is None, "the stand-in server ended before its playbook ran"
            running = playbooks_under(tmp_path)
            time.sleep(0.2)
        assert running and task_runs(tmp_path), "the playbook's task never started"
        running = playbooks_under(tmp_path)  # every ansible-playbook process now (the main one and its fork)
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
        assert procs.wait_gone(running, 20) == [], "the dead server's ansible-playbook runs on"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
        for pid in playbooks_under(tmp_path):  # whatever the test left (only on failure)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
