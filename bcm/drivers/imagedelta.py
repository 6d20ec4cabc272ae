"""What differs between two versions of an image's root tree, as one archive (#30: an `auto` sync over the wire).

An installed node holding version A of an image syncs to version B by fetching only this archive: the files of
B that are new or differ from A (content, type, mode, owner, link target), and a list of A's paths B no longer
has (member ``.bcm-delta-removed``, first in the archive, one relative path per line). The node's init applies
it with busybox alone: removals first (a path whose type changed is among them), then ``tar -x`` over the
disk's root.

Both root images are unpacked with ``unsquashfs`` into a scratch directory beside the result, compared, and
the archive written by GNU tar (``--null --files-from``, GNU format, numeric owners: what busybox's tar reads).
The scratch trees are removed whatever happens; the archive is written under a temporary name and renamed, so
a reader sees a whole archive or none. Every external command has a timeout.

Paths a sync never touches (the node's own files: keys, fstab, the install record; logs; the layout's other
filesystems) are ``skip`` patterns, matched as the init's rsync excludes are (a pattern with a trailing ``/``
covers a directory's contents; ``*`` globs).
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import stat
import subprocess
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REMOVED = ".bcm-delta-removed"
# what an `auto` sync leaves as the node has it (templates/image/init's rsync excludes for auto)
SKIP = (
    "/lost+found",
    "/etc/bcm-installed",
    "/etc/bcm/",
    "/etc/ssh/ssh_host_*",
    "/etc/fstab",
    "/etc/hostname",
    "/etc/hosts",
    "/boot/bcm/",
    "/boot/grub/",
    "/root/.ssh/",
    "/var/log/",
    "/etc/machine-id",
)
CHUNK = 1 << 20


class DeltaError(Exception):
    """No archive: the reason, for the log and the event (the node then syncs from the whole root image)."""


@dataclass(frozen=True)
class Delta:
    path: Path
    changed: int  # entries in the archive (files, directories, links), the removal list not counted
    removed: int
    size: int  # bytes of the archive


def _skipped(rel: str, skip: Sequence[str]) -> bool:
    """``rel`` is "/etc/x"; a pattern "/etc/bcm/" skips the directory and all under it."""
    for pattern in skip:
        if pattern.endswith("/"):
            base = pattern.rstrip("/")
            if rel == base or rel.startswith(base + "/"):
                return True
        elif fnmatch.fnmatchcase(rel, pattern):  # a directory matched is not descended (_walk)
            return True
    return False


def _walk(root: Path, skip: Sequence[str]) -> dict[str, os.stat_result]:
    """Every path under ``root`` (never following links), by "/relative" name, skipped ones left out."""
    found: dict[str, os.stat_result] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = "/" + os.path.relpath(dirpath, root) if dirpath != str(root) else ""
        keep = []
        for name in dirnames:
            rel = f"{rel_dir}/{name}"
            if _skipped(rel, skip):
                continue
            st = os.lstat(os.path.join(dirpath, name))
            found[rel] = st
            if stat.S_ISDIR(st.st_mode):
                keep.append(name)
        dirnames[:] = keep  # os.walk lists a symlink to a directory among dirnames: never descended
        for name in filenames:
            rel = f"{rel_dir}/{name}"
            if not _skipped(rel, skip):
                found[rel] = os.lstat(os.path.join(dirpath, name))
    return found


def _same_content(a: Path, b: Path) -> bool:
    with a.open("rb") as fa, b.open("rb") as fb:
        while True:
            ca, cb = fa.read(CHUNK), fb.read(CHUNK)
            if ca != cb:
                return False
            if not ca:
                return True


def _differs(old_root: Path, new_root: Path, rel: str, old: os.stat_result, new: os.stat_result) -> bool:
    if stat.S_IFMT(old.st_mode) != stat.S_IFMT(new.st_mode):
        return True
    if (stat.S_IMODE(old.st_mode), old.st_uid, old.st_gid) != (
        stat.S_IMODE(new.st_mode),
        new.st_uid,
        new.st_gid,
    ):
        return True
    if stat.S_ISLNK(new.st_mode):
        return os.readlink(old_root / rel[1:]) != os.readlink(new_root / rel[1:])
    if stat.S_ISREG(new.st_mode):
        return old.st_size != new.st_size or not _same_content(old_root / rel[1:], new_root / rel[1:])
    if stat.S_ISCHR(new.st_mode) or stat.S_ISBLK(new.st_mode):
        return old.st_rdev != new.st_rdev
    return False  # a directory, a fifo or a socket: its mode and owner are all it has


def compare(old_root: Path, new_root: Path, skip: Sequence[str] = SKIP) -> tuple[list[str], list[str]]:
    """(changed, removed): paths of ``new_root`` to send, in walk order (a directory before what it holds),
    and paths of ``old_root`` to remove first (gone from the new tree, or of another type in it; a removed
    directory's contents are not listed: it goes whole)."""
    old = _walk(old_root, skip)
    new = _walk(new_root, skip)
    changed = [
        rel for rel, st in new.items() if rel not in old or _differs(old_root, new_root, rel, old[rel], st)
    ]
    removed: list[str] = []
    gone_dirs: set[str] = set()
    for rel, st in old.items():
        if rel in new and stat.S_IFMT(st.st_mode) == stat.S_IFMT(new[rel].st_mode):
            continue
        parent = rel.rsplit("/", 1)[0]
        while parent and parent not in gone_dirs:
            parent = parent.rsplit("/", 1)[0]
        if parent:  # under a directory that goes whole
            continue
        removed.append(rel)
        if stat.S_ISDIR(st.st_mode):
            gone_dirs.add(rel)
    for rel in (*changed, *removed):
        if "\n" in rel:
            raise DeltaError(f"a path with a newline in it ({rel!r}): no delta, the whole image is synced")
    return changed, removed


def _run(argv: list[str], what: str, timeout_s: float, stop: threading.Event | None) -> None:
    """``argv`` to its end, killed at ``timeout_s`` or as soon as ``stop`` is set (the server shuts down)."""
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
    except FileNotFoundError as exc:
        raise DeltaError(f"{what}: {argv[0]} is not installed") from exc
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                _, err = proc.communicate(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if stop is not None and stop.is_set():
                    raise DeltaError(f"{what}: stopped (the server is shutting down)") from None
                if time.monotonic() > deadline:
                    raise DeltaError(f"{what}: no end after {timeout_s:.0f} s") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        text = err.decode(errors="replace").strip()[-500:]
        raise DeltaError(f"{what} failed (exit {proc.returncode}): {text}")


def build(
    old_rootfs: Path,
    new_rootfs: Path,
    out: Path,
    *,
    skip: Sequence[str] = SKIP,
    timeout_s: float = 1800.0,
    stop: threading.Event | None = None,
) -> Delta:
    """The archive from ``old_rootfs`` to ``new_rootfs`` (squashfs files) at ``out`` (gzip'd tar)."""
    if os.geteuid() != 0:
        # unsquashfs as another user leaves every file its own: owners could not be compared nor sent
        raise DeltaError("unpacking root images with their owners needs root: no delta")
    scratch = out.parent / f".delta-{uuid.uuid4().hex[:12]}"
    scratch.mkdir(parents=True)
    try:
        trees = []
        for which, squashfs in (("old", old_rootfs), ("new", new_rootfs)):
            tree = scratch / which
            _run(
                ["unsquashfs", "-no-progress", "-quiet", "-d", str(tree), str(squashfs)],
                f"unsquashfs {squashfs.name} ({which})",
                timeout_s,
                stop,
            )
            trees.append(tree)
        changed, removed = compare(trees[0], trees[1], skip)
        (trees[1] / REMOVED).write_text("".join(r[1:] + "\n" for r in removed))
        listing = scratch / "members"
        listing.write_bytes(b"".join(os.fsencode(m) + b"\0" for m in [REMOVED, *(c[1:] for c in changed)]))
        partial = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}")
        _run(
            [
                "tar",
                "--create",
                "--gzip",
                "--format=gnu",
                "--numeric-owner",
                "--no-recursion",
                f"--file={partial}",
                f"--directory={trees[1]}",
                "--null",
                f"--files-from={listing}",
            ],
            "tar of the changed files",
            timeout_s,
            stop,
        )
        os.replace(partial, out)
        return Delta(out, len(changed), len(removed), out.stat().st_size)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        for stale in out.parent.glob(f".{out.name}.*"):
            stale.unlink(missing_ok=True)
