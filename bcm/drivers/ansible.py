"""Ansible playbooks through ansible-runner: inventory from the database, per-host recaps. The only
ansible-runner user.

Each run gets a private directory (0700) holding the inventory, a known_hosts file built from the
host keys bcm pinned, and the runner's artifacts; it is deleted afterwards. Secrets never travel as
variables: roles copy them from 0600 files on the head node with ``no_log``, so neither the extra
vars file nor the event stream holds them. OpenSSH ControlPersist masters are closed after the run.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bcm import resources
from bcm.errors import DriverError, FatalDriverError

log = logging.getLogger(__name__)


def playbook_dir() -> Path:
    """``$BCM_ANSIBLE_DIR``, else bcm's own ``ansible/`` (package data, :mod:`bcm.resources`)."""
    for candidate in (os.environ.get("BCM_ANSIBLE_DIR"), resources.ansible_dir()):
        if candidate and (Path(candidate) / "roles").is_dir():
            return Path(candidate)
    raise FatalDriverError("no ansible/ directory with roles found (set BCM_ANSIBLE_DIR)")


_FAIL_EVENTS = {"runner_on_failed", "runner_on_unreachable"}
PR_SET_PDEATHSIG = 1
_starting = threading.local()  # .playbook: this thread is inside ansible_runner.run


def _die_with_the_server() -> None:
    """In a child forked by a thread that runs a playbook (ansible-runner's pexpect child, before it execs
    ansible-playbook): have the kernel send it SIGTERM when that thread, so the server, goes — even by
    kill -9. ansible-playbook passes SIGTERM on to its workers (SIGKILL would leave them, and their task, to
    run on). Otherwise a dead server's playbook runs on while the server that takes its operation up runs
    it again on the same nodes (#27). Linux's prctl(PR_SET_PDEATHSIG); it survives the exec."""
    if not getattr(_starting, "playbook", False):
        return
    with contextlib.suppress(OSError, AttributeError):  # not Linux: nothing to ask the kernel
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


os.register_at_fork(after_in_child=_die_with_the_server)


@dataclass(frozen=True)
class AnsibleHost:
    """One inventory host: ``host_key`` is the pinned OpenSSH public key line bcm stored for it."""

    name: str
    address: str
    host_key: str
    groups: tuple[str, ...]
    port: int = 22


@dataclass
class HostRecap:
    name: str
    ok: int = 0
    changed: int = 0
    failed: int = 0
    unreachable: int = 0
    skipped: int = 0
    error: str | None = None
    ran: bool = False

    @property
    def status(self) -> str:
        if self.unreachable:
            return "unreachable"
        if self.failed:
            return "failed"
        return "ok" if self.ran else "not_run"


@dataclass
class PlaybookResult:
    status: str  # successful | failed | timeout | canceled
    rc: int
    hosts: dict[str, HostRecap]
    duration_s: float
    output_tail: str = ""
    errors: list[str] = field(default_factory=list)
    task_seconds: dict[str, float] = field(default_factory=dict)  # task name -> slowest host's time
    notes: list[str] = field(default_factory=list)  # what the workload manager did beside the playbook
    changed_tasks: list[str] = field(
        default_factory=list
    )  # "host: task" for each task that changed something

    def slowest(self, n: int = 5) -> list[tuple[str, float]]:
        return sorted(self.task_seconds.items(), key=lambda kv: -kv[1])[:n]

    @property
    def changed(self) -> int:
        return sum(h.changed for h in self.hosts.values())


def _known_hosts(hosts: Sequence[AnsibleHost]) -> str:
    lines = []
    for h in hosts:
        key = " ".join(h.host_key.split()[:2])
        names = h.address if h.port == 22 else f"[{h.address}]:{h.port}"
        lines.append(f"{names},{h.name} {key}")
    return "\n".join(lines) + "\n"


def _inventory(hosts: Sequence[AnsibleHost], key_file: Path, username: str) -> dict[str, Any]:
    groups: dict[str, dict[str, Any]] = {}
    for h in hosts:
        for g in h.groups:
            groups.setdefault(g, {"hosts": {}})["hosts"][h.name] = {
                "ansible_host": h.address,
                "ansible_port": h.port,
            }
    return {
        "all": {
            "vars": {
                "ansible_user": username,
                "ansible_ssh_private_key_file": str(key_file),
                "ansible_python_interpreter": "/usr/bin/python3",
            },
            "children": groups,
        }
    }


def _ansible_bin(name: str) -> str:
    beside = Path(sys.executable).parent / name  # the virtualenv the server runs from
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise FatalDriverError(f"{name} not found; install ansible-core next to bcm")
    return found


_JINJA = ("{{", "{%", "{#")


def _jinja_in(value: Any, path: str = "") -> str | None:
    """The path of the first string in extra vars that Ansible would template, or None."""
    if isinstance(value, str):
        return path or "value" if any(m in value for m in _JINJA) else None
    items = (
        value.items()
        if isinstance(value, Mapping)
        else enumerate(value)
        if isinstance(value, list | tuple)
        else ()
    )
    for key, item in items:
        found = _jinja_in(item, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


def run_playbook(
    playbook: str,
    hosts: Sequence[AnsibleHost],
    extravars: Mapping[str, Any],
    *,
    key_file: Path,
    work_dir: Path,
    username: str = "root",
    forks: int = 64,
    connect_timeout_s: float = 10.0,
    timeout_s: float = 1800.0,
) -> PlaybookResult:
    """Run ``ansible/<playbook>`` against ``hosts``; per-host recaps, never an exception per host.

    Raises DriverError only when the run itself could not start or produced no recap.
    """
    import ansible_runner  # imported here: importing it pulls in much of Ansible

    playbooks = playbook_dir()

    templated = _jinja_in(extravars)
    if templated:
        raise FatalDriverError(f"extra var {templated} holds Jinja syntax; bcm passes rendered text as files")
    missing = [h.name for h in hosts if not h.host_key]
    if missing:
        raise FatalDriverError(f"no pinned SSH host key for {', '.join(missing)}; inventory them first")
    work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    private = Path(tempfile.mkdtemp(prefix="run-", dir=work_dir))
    # Unix socket paths are short (108 bytes): ControlPath lives in a short /tmp dir, not the state dir.
    control_dir = Path(tempfile.mkdtemp(prefix="bcm-cp-"))
    known_hosts = private / "known_hosts"
    known_hosts.write_text(_known_hosts(hosts))
    ssh_args = " ".join(
        [
            f"-o UserKnownHostsFile={known_hosts}",
            "-o GlobalKnownHostsFile=/dev/null",
            "-o StrictHostKeyChecking=yes",
            "-o ControlMaster=auto",
            "-o ControlPersist=60s",
            f"-o ControlPath={control_dir}/%C",
            "-o ServerAliveInterval=15",
            "-o ServerAliveCountMax=3",
            "-F /dev/null",  # the invoking user's ~/.ssh/config does not apply
        ]
    )
    envvars = {
        "ANSIBLE_SSH_ARGS": ssh_args,
        "ANSIBLE_HOST_KEY_CHECKING": "True",
        "ANSIBLE_PIPELINING": "True",
        "ANSIBLE_TIMEOUT": str(int(connect_timeout_s)),
        "ANSIBLE_FORKS": str(forks),
        "ANSIBLE_ROLES_PATH": str(playbooks / "roles"),
        "ANSIBLE_RETRY_FILES_ENABLED": "False",
        "ANSIBLE_NOCOLOR": "True",
        "ANSIBLE_LOCAL_TEMP": str(private / "tmp"),
        "ANSIBLE_HOME": str(private / "home"),
        "ANSIBLE_GATHERING": "explicit",
        "ANSIBLE_DISPLAY_ARGS_TO_STDOUT": "False",
        # ansible-playbook from the server's own environment first (runner runs it by name)
        "PATH": os.pathsep.join(
            [str(Path(_ansible_bin("ansible-playbook")).parent), os.environ.get("PATH", "/usr/bin:/bin")]
        ),
    }
    started = time.monotonic()
    _starting.playbook = True  # its child dies with this thread (see _die_with_the_server)
    try:
        runner = ansible_runner.run(
            private_data_dir=str(private),
            project_dir=str(playbooks),
            playbook=playbook,
            inventory=_inventory(hosts, key_file, username),
            extravars=dict(extravars),
            envvars=envvars,
            forks=forks,
            timeout=int(timeout_s),
            quiet=True,
            json_mode=False,
            suppress_env_files=False,
        )
        result = _collect(runner, hosts, time.monotonic() - started)
    except DriverError:
        raise
    except Exception as exc:  # the runner itself broke (bad binary, unreadable dir)
        raise DriverError(f"ansible-runner failed to run {playbook}: {type(exc).__name__}: {exc}") from exc
    finally:
        _starting.playbook = False
        _close_masters(control_dir)
        shutil.rmtree(private, ignore_errors=True)
    log.info(
        "playbook %s: %s rc=%s changed=%s in %.1fs",
        playbook,
        result.status,
        result.rc,
        result.changed,
        result.duration_s,
    )
    return result


def _collect(runner: Any, hosts: Sequence[AnsibleHost], duration_s: float) -> PlaybookResult:
    recaps = {h.name: HostRecap(h.name) for h in hosts}
    stats = runner.stats or {}
    for key, attr in (
        ("ok", "ok"),
        ("changed", "changed"),
        ("failures", "failed"),
        ("dark", "unreachable"),
        ("skipped", "skipped"),
    ):
        for host, count in (stats.get(key) or {}).items():
            if host in recaps:
                setattr(recaps[host], attr, int(count))
                recaps[host].ran = True
    for host in stats.get("processed") or {}:
        if host in recaps:
            recaps[host].ran = True
    errors: list[str] = []
    changed: list[str] = []
    task_seconds: dict[str, float] = {}
    for event in runner.events:
        data = event.get("event_data") or {}
        if event.get("event", "").startswith("runner_on_") and isinstance(data.get("duration"), int | float):
            label = str(data.get("task") or "?")
            task_seconds[label] = max(task_seconds.get(label, 0.0), float(data["duration"]))
        if event.get("event") in ("runner_on_ok", "runner_item_on_ok") and (data.get("res") or {}).get(
            "changed"
        ):
            changed.append(f"{data.get('host')}: {data.get('task')}")
        if event.get("event") not in _FAIL_EVENTS:
            continue
        if data.get("ignore_errors"):
            continue
        host, task = data.get("host"), data.get("task")
        message = _message(data.get("res") or {})
        line = f"{task}: {message}"
        errors.append(f"{host}: {line}")
        if host in recaps and recaps[host].error is None:
            recaps[host].error = line[:1000]
    try:
        tail = runner.stdout.read()[-8000:]
    except (OSError, AttributeError):
        tail = ""
    return PlaybookResult(
        status=str(runner.status),
        rc=int(runner.rc if runner.rc is not None else -1),
        hosts=recaps,
        duration_s=duration_s,
        output_tail=tail,
        errors=errors,
        task_seconds=task_seconds,
        changed_tasks=list(dict.fromkeys(changed)),
    )


def _message(res: Mapping[str, Any]) -> str:
    """A short reason from a task result (censored results say so and nothing more)."""
    if res.get("censored"):
        return "failed (output hidden: the task handles a secret)"
    msg = res.get("msg") or ""
    stderr = str(res.get("stderr") or "").strip()
    if stderr:
        msg = f"{msg}: {stderr.splitlines()[-1]}" if msg else stderr.splitlines()[-1]
    return str(msg)[:500] or "failed"


def _close_masters(control_dir: Path) -> None:
    """Close OpenSSH ControlPersist masters this run left behind, then remove their directory."""
    for sock in control_dir.glob("*"):
        subprocess.run(
            ["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "bcm-control-master"],
            capture_output=True,
            timeout=10,
            check=False,
        )
    shutil.rmtree(control_dir, ignore_errors=True)
