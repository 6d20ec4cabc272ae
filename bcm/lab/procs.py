"""Process plumbing for the lab: running commands, reading /proc, finding and signalling processes.

Processes are named by (pid, start time) so that a record read back from the state file by another
process never signals a stranger that reused the pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from bcm.lab.errors import LabError

COMMAND_TIMEOUT_S = 60.0


def run(argv: Sequence[str], *, stdin: str | None = None, timeout: float = COMMAND_TIMEOUT_S) -> str:
    """Run a command to completion and return its stdout; a failure becomes a LabError with stderr."""
    try:
        proc = subprocess.run(
            list(argv), input=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError as exc:
        raise LabError(f"{argv[0]} is not installed") from exc
    except subprocess.TimeoutExpired as exc:
        raise LabError(f"`{' '.join(argv)}` did not finish within {timeout:.0f} s") from exc
    if proc.returncode != 0:
        shown = " ".join(argv) if stdin is None else f"{' '.join(argv)} <<{stdin[:500]!r}"
        raise LabError(f"`{shown}` failed (exit {proc.returncode}): {proc.stderr.strip()[-1500:]}")
    return proc.stdout


def stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (index 0 is the state), or None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name may hold spaces and parentheses; it ends at the last ')'.
    return text[text.rfind(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """Start time of a live process in clock ticks since boot; None if gone or a zombie."""
    fields = stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def is_alive(pid: int | None, started: int | None) -> bool:
    """Whether the process recorded as (pid, start time) still runs."""
    return pid is not None and started is not None and start_time(pid) == started


def is_stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal (SIGSTOP)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] == "T"


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def children(pid: int) -> list[int]:
    """Direct children of a process (all its threads)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return found
    for task in tasks:
        try:
            found += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def ns_id(pid: int, kind: str) -> str | None:
    """The namespace link of a process, e.g. 'net:[4026532281]'; None if gone."""
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def netns_file_id(path: Path) -> str | None:
    """The namespace link that a bind-mounted /run/netns file stands for."""
    try:
        return f"net:[{os.stat(path).st_ino}]"
    except FileNotFoundError:
        return None


def pids_in_namespaces(kind: str, ids: Iterable[str]) -> list[int]:
    """Every process whose namespace of this kind is one of ids (our own process excluded)."""
    wanted = set(ids)
    me = os.getpid()
    return [pid for pid in all_pids() if pid != me and ns_id(pid, kind) in wanted]


def pids_rooted_under(directory: Path) -> list[int]:
    """Processes whose root directory lies under directory (chrooted node processes)."""
    prefix = str(directory).rstrip("/") + "/"
    found = []
    for pid in all_pids():
        try:
            root = os.readlink(f"/proc/{pid}/root")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if root.startswith(prefix):
            found.append(pid)
    return found


def send(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_gone(pids: Sequence[int], timeout: float) -> list[int]:
    """Wait until none of pids runs (zombies count as gone); return those still running."""
    deadline = time.monotonic() + timeout
    left = [pid for pid in pids if start_time(pid) is not None]
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [pid for pid in left if start_time(pid) is not None]
    return left


def listening_on(pid: int, port: int) -> bool:
    """Whether some socket in the process's network namespace listens on the TCP port."""
    wanted = f":{port:04X}"
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 3 and cols[1].endswith(wanted) and cols[3] == "0A":
                return True
    return False


def mounts_under(directory: Path) -> list[str]:
    """Mount points in our mount namespace at or below directory, deepest first."""
    base = str(directory).rstrip("/")
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        # Mount points escape spaces and such as octal (\040).
        point = line.split()[1].encode().decode("unicode_escape")
        if point == base or point.startswith(base + "/"):
            found.append(point)
    return sorted(found, key=len, reverse=True)
