"""Pushing a root filesystem tree onto running nodes: the only module that runs rsync (and unsquashfs).

:func:`push` runs ``rsync -aHAX --delete --numeric-ids --itemize-changes`` (``--dry-run`` for a dry
run) from a local tree to ``/`` on many nodes at once, over OpenSSH with the server's key. Host keys
come from bcm's database, never from first contact: every push writes its own known_hosts file from
the pins (one line per node, matched through ``HostKeyAlias``), with ``StrictHostKeyChecking=yes``,
so a node whose key differs is refused before anything is sent. A target without a pinned key is a
programming error here (the service refuses such nodes before calling).

Per-node outcomes are data (:class:`PushResult`), never exceptions: one dead node never fails a push.
Statuses: ``ok``, ``host_key_changed``, ``unreachable``, ``auth_failed``, ``timed_out``, ``error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bcm.drivers.fanout import fan_out
from bcm.errors import FatalDriverError

__all__ = ["ALWAYS_EXCLUDE", "PushResult", "PushTarget", "push", "unpack_squashfs"]

# Kernel and runtime filesystems of a running node: never part of an image push, whatever the recipe says.
ALWAYS_EXCLUDE: tuple[str, ...] = ("/proc", "/sys", "/dev", "/run")
DEFAULT_CONCURRENCY = 8  # each push is a disk- and CPU-heavy rsync on both ends; a small cap
DEFAULT_TIMEOUT_S = 1800.0
SAMPLE_LINES = 10
UNPACK_TIMEOUT_S = 1800.0
_MARKER = "complete"
# --itemize-changes: "YXcstpoguax path" (Y: < > c h . ; X: f d L D S), or "*deleting path"
_ITEM = re.compile(r"^(\*deleting +|[<>ch.][fdLDS][.+?a-zA-Z ]{9} )\S")
_TRANSFERRED = re.compile(r"^Total transferred file size: ([\d,.]+) bytes")
_HOST_KEY_CHANGED = ("REMOTE HOST IDENTIFICATION HAS CHANGED", "Host key verification failed")
_UNREACHABLE = (
    "Connection refused",
    "No route to host",
    "Connection timed out",
    "Operation timed out",
    "Network is unreachable",
    "Could not resolve hostname",
    "Connection reset",
    "Connection closed by",
    "connect to host",
)


@dataclass(frozen=True)
class PushTarget:
    """One node to push to; ``host_key`` is its pinned OpenSSH public key line (``type base64``)."""

    name: str
    address: str
    host_key: str
    port: int = 22


@dataclass
class PushResult:
    name: str
    status: str
    changed: int = 0  # itemized lines: files, links, directories created, changed or deleted
    sample: list[str] = field(default_factory=list)
    bytes: int | None = None  # rsync's "total transferred file size" (what a dry run would send)
    error: str | None = None
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["message"] = self.error or ""
        return data


OnResult = Callable[[PushResult], object | Awaitable[object]]


def _host_key_line(alias: str, key: str) -> str:
    parts = key.split()
    if len(parts) < 2 or not parts[0].startswith(("ssh-", "ecdsa-", "sk-")):
        raise FatalDriverError(f"{alias}: the pinned host key is not an OpenSSH public key line")
    return f"{alias} {parts[0]} {parts[1]}\n"


def ssh_command(
    target: PushTarget, *, key_file: Path, known_hosts: Path, username: str, connect_timeout_s: float
) -> str:
    """The ``rsync -e`` command for one node: our key, bcm's pins only, no prompts, no user config."""
    q = shlex.quote
    options = [
        f"UserKnownHostsFile={q(str(known_hosts))}",
        "GlobalKnownHostsFile=/dev/null",
        f"HostKeyAlias={q(target.name)}",
        "StrictHostKeyChecking=yes",
        "CheckHostIP=no",
        "UpdateHostKeys=no",
        "BatchMode=yes",
        "IdentitiesOnly=yes",
        "IdentityAgent=none",
        "ControlMaster=no",
        "ControlPath=none",
        f"ConnectTimeout={max(1, int(connect_timeout_s))}",
        "ServerAliveInterval=15",
        "ServerAliveCountMax=4",
        f"User={q(username)}",
    ]
    parts = ["ssh", "-F", "/dev/null", "-i", q(str(key_file)), "-p", str(target.port)]
    for option in options:
        parts += ["-o", option]
    return " ".join(parts)


def rsync_argv(
    source: Path, target: PushTarget, excludes: Sequence[str], ssh: str, *, dry_run: bool, io_timeout_s: int
) -> list[str]:
    host = f"[{target.address}]" if ":" in target.address else target.address
    argv = ["rsync", "-aHAX", "--delete", "--numeric-ids", "--itemize-changes", "--stats"]
    if dry_run:
        argv.append("--dry-run")
    argv.append(f"--timeout={io_timeout_s}")
    for path in dict.fromkeys([*ALWAYS_EXCLUDE, *excludes]):
        argv.append(f"--exclude={path}")
    # the address is a plain IP from the database; "--" keeps an odd one from reading as an option
    return [*argv, "-e", ssh, "--", f"{source}/", f"{host}:/"]


def parse_output(stdout: str) -> tuple[int, list[str], int | None]:
    """(itemized lines, the first few of them, bytes transferred or None) from rsync's output."""
    changed: int = 0
    sample: list[str] = []
    size: int | None = None
    for line in stdout.splitlines():
        if _ITEM.match(line):
            changed += 1
            if len(sample) < SAMPLE_LINES:
                sample.append(line)
            continue
        found = _TRANSFERRED.match(line)
        if found:
            size = int(found.group(1).replace(",", "").replace(".", ""))
    return changed, sample, size


def classify(returncode: int, stderr: str) -> tuple[str, str | None]:
    """(status, error) for one finished rsync."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if any(marker in stderr for marker in _HOST_KEY_CHANGED):
        return (
            "host_key_changed",
            "the node's SSH host key differs from the key pinned in bcm; nothing was sent",
        )
    if returncode == 0:
        return "ok", None
    if returncode == 24:  # files vanished on the sending side while it ran: the rest went through
        return "ok", None
    if "Permission denied" in stderr:
        return "auth_failed", "the node refused bcm's SSH key (Permission denied)"
    if any(marker in stderr for marker in _UNREACHABLE):
        first = next((line for line in lines if line.startswith("ssh:") or "connect to host" in line), None)
        return "unreachable", (first or lines[-1])[:300]
    detail = next((line for line in lines if line.startswith("rsync error") or "error" in line.lower()), None)
    return "error", f"rsync exited {returncode}: {(detail or (lines[-1] if lines else 'no output'))[:300]}"


async def _run_one(
    source: Path,
    target: PushTarget,
    excludes: Sequence[str],
    *,
    key_file: Path,
    known_hosts: Path,
    username: str,
    connect_timeout_s: float,
    timeout_s: float,
    dry_run: bool,
) -> PushResult:
    started = time.monotonic()
    ssh = ssh_command(
        target,
        key_file=key_file,
        known_hosts=known_hosts,
        username=username,
        connect_timeout_s=connect_timeout_s,
    )
    argv = rsync_argv(
        source, target, excludes, ssh, dry_run=dry_run, io_timeout_s=max(30, int(connect_timeout_s * 6))
    )
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: a timeout kills ssh too
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "HOME": "/nonexistent"},
        )
    except FileNotFoundError:
        return PushResult(
            target.name, "error", error="rsync is not installed on the server (apt-get install rsync)"
        )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except (TimeoutError, asyncio.CancelledError) as exc:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        if isinstance(exc, asyncio.CancelledError):
            raise
        return PushResult(
            target.name,
            "timed_out",
            error=f"push did not finish within {timeout_s:.0f} s",
            duration_s=time.monotonic() - started,
        )
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    status, error = classify(proc.returncode or 0, stderr)
    changed, sample, size = parse_output(stdout)
    return PushResult(target.name, status, changed, sample, size, error, time.monotonic() - started)


async def push(
    source: Path,
    targets: Sequence[PushTarget],
    excludes: Sequence[str],
    *,
    key_file: Path,
    dry_run: bool = True,
    username: str = "root",
    connect_timeout_s: float = 10.0,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    concurrency: int = DEFAULT_CONCURRENCY,
    on_result: OnResult | None = None,
) -> list[PushResult]:
    """Push ``source`` to ``/`` on every target, at most ``concurrency`` at once; results in input order.

    ``on_result`` is called (and awaited if it returns an awaitable) once per node as it finishes, one
    at a time, from this coroutine. Each node is bounded by ``timeout_s``.
    """
    if not (source / "etc").is_dir() or not (source / "usr").is_dir():
        raise FatalDriverError(f"image push: {source} does not look like a root filesystem (no etc/, usr/)")
    if not key_file.is_file():
        raise FatalDriverError(f"image push: the server's SSH key {key_file} is missing")
    with tempfile.TemporaryDirectory(prefix="bcm-push-") as tmp:
        known_hosts = Path(tmp) / "known_hosts"
        known_hosts.write_text("".join(_host_key_line(t.name, t.host_key) for t in targets))

        async def one(target: PushTarget) -> PushResult:
            try:
                return await _run_one(
                    source,
                    target,
                    excludes,
                    key_file=key_file,
                    known_hosts=known_hosts,
                    username=username,
                    connect_timeout_s=connect_timeout_s,
                    timeout_s=timeout_s,
                    dry_run=dry_run,
                )
            except OSError as exc:  # fork failed, too many files: this node's failure only
                return PushResult(target.name, "error", error=f"could not run rsync: {exc}")

        return await fan_out(targets, one, concurrency, on_result)


# ---- the tree to push when a version's cached layer is gone -------------------------------------------


def unpack_squashfs(
    squashfs: Path, sha256: str, cache_dir: Path, timeout_s: float = UNPACK_TIMEOUT_S
) -> Path:
    """The tree of ``squashfs`` unpacked once into ``cache_dir/unpacked/<sha256>/rootfs`` (locked, atomic)."""
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise FatalDriverError(f"image push: {sha256!r} is not a sha256")
    final = cache_dir / "unpacked" / sha256
    if (final / _MARKER).exists():
        return final / "rootfs"
    if not squashfs.is_file():
        raise FatalDriverError(
            f"image push: neither the cached layer nor {squashfs} exists; rebuild the image"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.with_name(sha256 + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second push of the same version waits for the first unpack
        if (final / _MARKER).exists():
            return final / "rootfs"
        partial = final.with_name(sha256 + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        try:
            done = subprocess.run(
                ["unsquashfs", "-no-progress", "-d", str(partial / "rootfs"), str(squashfs)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                raise FatalDriverError(f"unsquashfs {squashfs} failed (exit {done.returncode}): {tail[0]}")
            (partial / _MARKER).write_text(json.dumps({"sha256": sha256, "from": str(squashfs)}) + "\n")
            shutil.rmtree(final, ignore_errors=True)
            os.rename(partial, final)
        except FileNotFoundError as exc:
            shutil.rmtree(partial, ignore_errors=True)
            raise FatalDriverError("unsquashfs is not installed (apt-get install squashfs-tools)") from exc
        except subprocess.TimeoutExpired as exc:
            shutil.rmtree(partial, ignore_errors=True)
            raise FatalDriverError(f"unsquashfs {squashfs} did not finish within {timeout_s:.0f} s") from exc
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    return final / "rootfs"
