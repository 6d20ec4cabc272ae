"""The lab nodes' shared root filesystem: a Debian bookworm tree built once with mmdebstrap and cached.

Nodes cannot install anything (the lab has no route out), so the tree carries what a bcm node image
would: sshd, python3 for Ansible and the agent, the hardware tools the inventory reads, and the Slurm
node packages. The cache directory is named by a hash of the recipe, so a changed package list builds
a new tree beside the old one. Builds run under an exclusive lock: concurrent test sessions wait for
one build instead of racing.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from bcm.lab.errors import LabError

DEFAULT_CACHE_DIR = Path("/var/cache/bcm")
SUITE = "bookworm"
PACKAGES: tuple[str, ...] = (
    "openssh-server",
    "python3",
    "python3-apt",
    "iproute2",
    "iputils-ping",
    "procps",
    "util-linux",
    "pciutils",
    "dmidecode",
    "ethtool",
    "kmod",
    "less",
    "rsync",
    "slurmd",
    "slurm-client",
    "slurmctld",  # any lab node may be the controller, so it carries the controller's packages too
    "slurmdbd",
    "slurm-wlm-mysql-plugin",
    "munge",
    "sudo",
    "libpam-runtime",
)
MIRRORS: tuple[str, ...] = (
    f"deb http://deb.debian.org/debian {SUITE} main",
    f"deb http://deb.debian.org/debian {SUITE}-updates main",
    f"deb http://deb.debian.org/debian-security {SUITE}-security main",
)
# Bump when the post-build steps below change, so old caches are not reused.
RECIPE_VERSION = "1"
BUILD_TIMEOUT_S = 1800
_DONE_MARK = ".bcm-lab-rootfs-complete"


def recipe_hash(packages: Sequence[str] = PACKAGES, suite: str = SUITE) -> str:
    """Short hash naming one recipe (suite, package list, post-build steps)."""
    text = "\n".join([RECIPE_VERSION, suite, *sorted(packages)])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def rootfs_path(cache_dir: Path = DEFAULT_CACHE_DIR, packages: Sequence[str] = PACKAGES) -> Path:
    """Where the tree for this recipe lives (built or not)."""
    return cache_dir / f"lab-rootfs-{recipe_hash(packages)}"


def ensure_rootfs(
    cache_dir: Path = DEFAULT_CACHE_DIR,
    packages: Sequence[str] = PACKAGES,
    mirrors: Sequence[str] = MIRRORS,
) -> Path:
    """Return the cached tree, building it first (about 40 s, needs the Debian mirror) if absent."""
    target = rootfs_path(cache_dir, packages)
    if (target / _DONE_MARK).exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / "lab-rootfs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Another process may have finished the build while we waited for the lock.
        if (target / _DONE_MARK).exists():
            return target
        _build(target, packages, mirrors)
    return target


def _build(target: Path, packages: Sequence[str], mirrors: Sequence[str]) -> None:
    partial = target.with_name(target.name + ".partial")
    for stale in (partial, target):
        if stale.exists():
            shutil.rmtree(stale)
    argv = [
        "mmdebstrap",
        "--variant=minbase",
        "--include=" + ",".join(packages),
        SUITE,
        str(partial),
        *mirrors,
    ]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    except FileNotFoundError as exc:
        raise LabError("mmdebstrap is not installed; install it with `apt-get install mmdebstrap`") from exc
    except subprocess.TimeoutExpired as exc:
        raise LabError(f"mmdebstrap did not finish within {BUILD_TIMEOUT_S} s") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-2000:]
        raise LabError(f"mmdebstrap failed (exit {proc.returncode}); is the Debian mirror reachable?\n{tail}")
    _finish(partial, target.name)
    os.rename(partial, target)


def _finish(root: Path, name: str) -> None:
    """Make the tree node-neutral: no host keys of its own, no machine id, a root home."""
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    machine_id = root / "etc/machine-id"
    if machine_id.exists():
        machine_id.write_text("")
    (root / "root/.ssh").mkdir(mode=0o700, parents=True, exist_ok=True)
    # Mount points the node start script uses; they must exist in the lower layer.
    for sub in ("proc", "sys", "dev", "run", "tmp"):
        (root / sub).mkdir(exist_ok=True)
    (root / _DONE_MARK).write_text(name + "\n")
