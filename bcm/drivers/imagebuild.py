"""The image builder: the only module that runs mmdebstrap, chroot, apt, mksquashfs and cpio for images.

A recipe chain (base first) becomes one cached tree per layer under ``cache_dir/layers/<key>/rootfs``,
where the key hashes the layer's recipe and everything below it (bcm.domain.image_recipe.layer_keys):

    layers/<key>.lock       exclusive fcntl lock; a second build of the same layer waits for the first
    layers/<key>.partial/   a layer being built; removed when the build fails
    layers/<key>/rootfs/    the finished tree
    layers/<key>/complete   the marker: written last, before the rename, so a tree without it never exists

The base comes from mmdebstrap; a layer above copies its parent's tree and runs apt in a chroot (its own
mount namespace with /proc, /sys, /dev bound in, a policy-rc.d that starts no service). Then
:func:`build` packs the top tree into ``staging``: ``vmlinuz``, bcm's own ``initramfs.img`` (static
busybox from the host, the virtio/squashfs/overlay modules from the image, templates/image/init),
``rootfs.squashfs`` and ``manifest.json``. Every command runs under a deadline; each output line goes
to ``log``. Failures raise FatalDriverError holding apt's last ``E:`` line.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import gzip
import hashlib
import json
import lzma
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from bcm import resources
from bcm.domain.image_recipe import BUILDER_VERSION, Recipe, layer_keys
from bcm.errors import FatalDriverError, InvalidInput

__all__ = ["BUILDER_VERSION", "Artifact", "BuildResult", "build", "layer_dir", "resolve", "verify"]

Log = Callable[[str], None]
Progress = Callable[[float], None]

HOST_BUSYBOX = Path("/bin/busybox")  # Debian busybox-static
MARKER = "complete"
# What the initramfs needs to reach the network, fetch the image and mount it (plus their dependencies).
INITRAMFS_MODULES = (
    "virtio_net",
    "virtio_blk",
    "virtio_pci",
    "net_failover",
    "failover",
    "squashfs",
    "overlay",
    "loop",
    # install to disk (#30): the layout's filesystems mounted by the installer, and an installed root booted
    # (bcm.disk=<device>); libcrc32c (xfs) finds its crc32c through the crypto API, a dependency modules.dep lacks
    "ext4",
    "crc32c_generic",
    "xfs",
)
# Left out of rootfs.squashfs (mksquashfs -wildcards, relative to the tree): Debian's own initrds,
# downloaded packages and apt lists (a node runs apt-get update before it installs anything).
SQUASHFS_EXCLUDE = (
    "boot/initrd.img*",
    "boot/*.img",
    "var/cache/apt/archives/*.deb",
    "var/lib/apt/lists/*",
    "tmp/*",
)
CHROOT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "DEBIAN_FRONTEND": "noninteractive",
    "LC_ALL": "C.UTF-8",
    "HOME": "/root",
}
APT_OPTIONS = "-q -y -o APT::Color=0 -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold"
# Runs on the host inside `unshare --mount --fork`: the mounts vanish with the namespace.
_CHROOT_WRAPPER = r"""
set -e
T=$1
mount --rbind /dev "$T/dev"
mount -t proc proc "$T/proc"
mount --rbind /sys "$T/sys"
mount --bind /etc/resolv.conf "$T/etc/resolv.conf"
exec chroot "$T" /bin/sh -ec "$2"
"""
# The same, for a throwaway overlay over a cached tree (resolve must never change the cache).
_OVERLAY_WRAPPER = r"""
set -e
L=$1; W=$2
mkdir -p "$W/upper" "$W/work" "$W/root"
mount -t overlay overlay -o "lowerdir=$L,upperdir=$W/upper,workdir=$W/work" "$W/root"
T=$W/root
mount --rbind /dev "$T/dev"
mount -t proc proc "$T/proc"
mount --rbind /sys "$T/sys"
mount --bind /etc/resolv.conf "$T/etc/resolv.conf"
exec chroot "$T" /bin/sh -ec "$3"
"""
_POLICY_RC_D = "#!/bin/sh\n# bcm image build: no service starts inside the build chroot\nexit 101\n"


@dataclass
class Artifact:
    """One file of a built image in its staging directory."""

    kind: str  # "kernel" | "initramfs" | "rootfs" | "manifest"
    filename: str
    size: int
    sha256: str


@dataclass
class BuildResult:
    """What build() left in ``staging``; ``manifest`` is also written there as manifest.json."""

    staging: Path
    artifacts: list[Artifact]
    manifest: dict


ARTIFACT_FILES = {
    "kernel": "vmlinuz",
    "initramfs": "initramfs.img",
    "rootfs": "rootfs.squashfs",
    "manifest": "manifest.json",
}


class _Deadline:
    def __init__(self, timeout_s: float) -> None:
        self.end = time.monotonic() + timeout_s
        self.total = timeout_s

    def left(self, what: str) -> float:
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise FatalDriverError(f"image build: {what} not started, the build ran past {self.total:.0f} s")
        return remaining


def _run(
    argv: list[str],
    *,
    what: str,
    log: Log,
    timeout_s: float,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> list[str]:
    """Run a command, streaming each output line to ``log``; its lines, or FatalDriverError."""
    lines: list[str] = []
    errors: list[str] = []
    tail: collections.deque[str] = collections.deque(maxlen=5)
    try:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            env=env,
            cwd=cwd,
            start_new_session=True,  # its own process group: a timeout kills apt, dpkg and DKMS too
        )
    except FileNotFoundError as exc:
        raise FatalDriverError(f"{what}: {argv[0]} is not installed ({exc.strerror})") from exc
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            lines.append(line)
            if line.strip():
                tail.append(line)
            if line.startswith("E: "):
                errors.append(line)
            log(line)
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            kill()
            proc.wait()
    if timed_out.is_set():
        raise FatalDriverError(f"{what} did not finish within {timeout_s:.0f} s")
    if rc != 0:
        detail = errors[-1] if errors else (tail[-1] if tail else "no output")
        if len(errors) > 1 and errors[0] != errors[-1]:
            detail = f"{errors[0]} ... {errors[-1]}"
        raise FatalDriverError(f"{what} failed (exit {rc}): {detail}")
    return lines


def layer_dir(cache_dir: Path, key: str) -> Path:
    """Where the layer with this key lives (``rootfs/`` and the ``complete`` marker inside)."""
    return cache_dir / "layers" / key


@contextlib.contextmanager
def _locked(path: Path, deadline: _Deadline, log: Log) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        waited = False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited:
                    log(f"bcm: waiting for another build of this layer ({path.name})")
                    waited = True
                deadline.left("waiting for another build of the same layer")
                time.sleep(1)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _in_chroot(tree: Path, script: str, *, what: str, log: Log, deadline: _Deadline) -> list[str]:
    resolv = tree / "etc/resolv.conf"
    if resolv.is_symlink() or not resolv.is_file():
        # a dangling link (systemd-resolved) or nothing: give the bind mount a plain file to land on
        if resolv.is_symlink() or resolv.exists():
            resolv.unlink()
        resolv.touch()
    argv = ["unshare", "--mount", "--fork", "sh", "-c", _CHROOT_WRAPPER, "bcm-chroot", str(tree), script]
    return _run(argv, what=what, log=log, timeout_s=deadline.left(what), env=CHROOT_ENV)


def _write_files(tree: Path, recipe: Recipe) -> None:
    for item in recipe.files:
        target = tree / item.path.lstrip("/")
        # a symlink on the way could point out of the tree; refuse rather than follow it
        for parent in [target, *target.parents]:
            if parent == tree:
                break
            if parent.is_symlink() and parent != target:
                raise FatalDriverError(
                    f"image {recipe.name}: files: {item.path} passes through a symlink in the image"
                )
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink():
            target.unlink()
        target.write_text(item.content)
        os.chmod(target, item.mode)


AGENT_BUNDLE = "opt/bcm/bcm-agent.pyz"  # where bcm-agent.service (the overlay) and `bcm agent deploy` look


def _write_agent(tree: Path, log: Log, step: str) -> None:
    """This checkout's agent zipapp (pynvml included where installed here) into the image."""
    from bcm.agent.bundle import build_bundle

    try:
        data = build_bundle()
    except FileNotFoundError:  # no pynvml here: the agent still runs on a node that has it
        data = build_bundle(include_pynvml=False)
    target = tree / AGENT_BUNDLE
    if any(p.is_symlink() for p in [target, *target.parents] if p != tree and tree in p.parents):
        raise FatalDriverError(f"{step}: {AGENT_BUNDLE} passes through a symlink in the image")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    os.chmod(target, 0o700)  # root runs it
    log(f"bcm: {step}: the bcm agent ({len(data)} bytes) at /{AGENT_BUNDLE}")


def _customize(tree: Path, recipe: Recipe, *, is_base: bool, log: Log, deadline: _Deadline) -> None:
    """Everything a layer does in the chroot: mirrors, packages, files, post, drops, clean."""
    policy = tree / "usr/sbin/policy-rc.d"
    policy.write_text(_POLICY_RC_D)
    policy.chmod(0o755)
    try:
        step = f"image {recipe.name}"
        if not is_base:
            if recipe.mirrors:
                (tree / f"etc/apt/sources.list.d/bcm-{recipe.name}.list").write_text(
                    "\n".join(recipe.mirrors) + "\n"
                )
            log(f"bcm: {step}: apt-get update")
            _in_chroot(
                tree,
                f"apt-get {APT_OPTIONS} update",
                what=f"{step}: apt-get update",
                log=log,
                deadline=deadline,
            )
            if recipe.packages:
                log(f"bcm: {step}: installing {' '.join(recipe.packages)}")
                script = f"apt-get {APT_OPTIONS} install --no-install-recommends {' '.join(recipe.packages)}"
                _in_chroot(tree, script, what=f"{step}: apt-get install", log=log, deadline=deadline)
        _write_files(tree, recipe)
        if recipe.agent:
            _write_agent(tree, log, step)
        for number, command in enumerate(recipe.post):
            log(f"bcm: {step}: post[{number}]: {command}")
            _in_chroot(tree, command, what=f"{step}: post[{number}] ({command})", log=log, deadline=deadline)
        if recipe.drop_packages:
            log(f"bcm: {step}: purging build-only packages {' '.join(recipe.drop_packages)}")
            script = f"apt-get {APT_OPTIONS} purge --autoremove {' '.join(recipe.drop_packages)}"
            _in_chroot(tree, script, what=f"{step}: apt-get purge", log=log, deadline=deadline)
        _in_chroot(tree, "apt-get clean", what=f"{step}: apt-get clean", log=log, deadline=deadline)
    finally:
        policy.unlink(missing_ok=True)


def _build_layer(
    recipe: Recipe, key: str, parent: Path | None, cache_dir: Path, log: Log, deadline: _Deadline
) -> Path:
    final = layer_dir(cache_dir, key)
    partial = final.with_name(key + ".partial")
    if partial.exists():
        shutil.rmtree(partial)  # left by a build that died without cleaning up
    partial.mkdir(parents=True)
    tree = partial / "rootfs"
    try:
        if parent is None:
            log(f"bcm: image {recipe.name}: mmdebstrap {recipe.suite} ({recipe.variant})")
            argv = [
                "mmdebstrap",
                f"--variant={recipe.variant}",
                "--mode=root",
                "--verbose",
            ]
            if recipe.packages:
                argv.append("--include=" + ",".join(recipe.packages))
            argv += [recipe.suite, str(tree), *recipe.mirrors]
            _run(
                argv, what=f"image {recipe.name}: mmdebstrap", log=log, timeout_s=deadline.left("mmdebstrap")
            )
        else:
            log(f"bcm: image {recipe.name}: copying the parent's tree")
            _run(
                ["cp", "-a", "--reflink=auto", str(parent), str(tree)],
                what=f"image {recipe.name}: copy of the parent tree",
                log=log,
                timeout_s=deadline.left("copy"),
            )
        _customize(tree, recipe, is_base=parent is None, log=log, deadline=deadline)
        marker = {"name": recipe.name, "key": key, "builder_version": BUILDER_VERSION, "built_at": _now()}
        (partial / MARKER).write_text(json.dumps(marker) + "\n")
        if final.exists():
            shutil.rmtree(final)  # a tree without its marker: an interrupted rename or a manual copy
        os.rename(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return final / "rootfs"


def _ensure_layers(
    layers: list[Recipe], cache_dir: Path, log: Log, progress: Progress, deadline: _Deadline, share: float
) -> tuple[Path, list[str]]:
    """Build (or reuse) every layer of the chain; the top tree and the keys."""
    if not layers:
        raise InvalidInput("an image needs at least one recipe", field="recipe")
    if layers[0].parent is not None:
        raise InvalidInput(f"the chain must start at a base; {layers[0].name!r} has a parent", field="recipe")
    keys = layer_keys(layers)
    tree: Path | None = None
    for index, (recipe, key) in enumerate(zip(layers, keys, strict=True)):
        final = layer_dir(cache_dir, key)
        if (final / MARKER).exists():
            log(f"bcm: image {recipe.name}: layer {key[:12]} cached")
        else:
            with _locked(final.with_name(key + ".lock"), deadline, log):
                if (final / MARKER).exists():  # built by someone else while we waited
                    log(f"bcm: image {recipe.name}: layer {key[:12]} built by another build")
                else:
                    log(f"bcm: image {recipe.name}: building layer {key[:12]}")
                    _build_layer(recipe, key, tree, cache_dir, log, deadline)
        tree = final / "rootfs"
        progress(share * (index + 1) / len(layers))
    assert tree is not None
    return tree, keys


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _version_key(text: str) -> list[int | str]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def kernel_version(tree: Path) -> str:
    """The image's kernel: the newest /lib/modules/<kver> that has a /boot/vmlinuz-<kver>."""
    modules = tree / "lib/modules"
    candidates = [d.name for d in modules.iterdir() if d.is_dir()] if modules.is_dir() else []
    with_kernel = [k for k in candidates if (tree / "boot" / f"vmlinuz-{k}").is_file()]
    if not with_kernel:
        raise FatalDriverError(
            "image has no kernel: no /boot/vmlinuz-<kver> beside /lib/modules/<kver> (add linux-image-amd64 to the base)"
        )
    return max(with_kernel, key=_version_key)


def _module_name(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    name = re.sub(r"\.ko(\.xz|\.zst|\.gz)?$", "", name)
    return name.replace("-", "_")


def initramfs_modules(tree: Path, kver: str, wanted: tuple[str, ...] = INITRAMFS_MODULES) -> list[str]:
    """The module files (relative to /lib/modules/<kver>) for ``wanted`` and their dependencies, in load order."""
    base = tree / "lib/modules" / kver
    deps: dict[str, tuple[str, list[str]]] = {}
    for line in (base / "modules.dep").read_text().splitlines():
        if ":" not in line:
            continue
        path, _, rest = line.partition(":")
        deps[_module_name(path)] = (path, [_module_name(d) for d in rest.split()])
    builtin_file = base / "modules.builtin"
    builtin = (
        {_module_name(line) for line in builtin_file.read_text().split()} if builtin_file.exists() else set()
    )
    order: list[str] = []

    def visit(name: str, stack: tuple[str, ...]) -> None:
        if name in builtin or deps.get(name, ("", []))[0] in order:
            return
        if name not in deps:
            raise FatalDriverError(
                f"initramfs: the image's kernel {kver} has no module {name} (needed by {stack or 'bcm'})"
            )
        path, needs = deps[name]
        for need in needs:
            if need not in stack:
                visit(need, (*stack, name))
        if path not in order:
            order.append(path)

    for name in wanted:
        visit(name.replace("-", "_"), ())
    return order


def _pack_initramfs(tree: Path, kver: str, out: Path, work: Path, log: Log, deadline: _Deadline) -> None:
    if not HOST_BUSYBOX.is_file():
        raise FatalDriverError(f"initramfs: {HOST_BUSYBOX} is missing; apt-get install busybox-static")
    root = work / "initramfs"
    for sub in ("bin", "dev", "proc", "sys", "etc/bcm", "newroot", "lower", "image", "rw", "run", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy2(HOST_BUSYBOX, root / "bin/busybox")
    applets = _run([str(HOST_BUSYBOX), "--list"], what="busybox --list", log=lambda _: None, timeout_s=30)
    for applet in applets:
        applet = applet.strip()
        if applet and applet != "busybox" and "/" not in applet:
            os.symlink("busybox", root / "bin" / applet)
    modules = initramfs_modules(tree, kver)
    for rel in modules:
        source = tree / "lib/modules" / kver / rel
        target = root / "lib/modules" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(".xz"):  # busybox insmod reads plain .ko files only
            target = target.with_suffix("")
            target.write_bytes(lzma.decompress(source.read_bytes()))
        elif rel.endswith(".gz"):
            target = target.with_suffix("")
            target.write_bytes(gzip.decompress(source.read_bytes()))
        elif rel.endswith(".zst"):
            raise FatalDriverError(
                f"initramfs: module {rel} is zstd-compressed; busybox insmod cannot load it"
            )
        else:
            shutil.copy2(source, target)
    listed = [re.sub(r"\.(xz|gz)$", "", rel) for rel in modules]
    (root / "etc/bcm/modules").write_text("".join(line + "\n" for line in listed))
    for name, mode in (("init", 0o755), ("udhcpc.script", 0o755)):
        destination = root / "init" if name == "init" else root / "etc/bcm" / name
        shutil.copyfile(resources.templates_dir() / "image" / name, destination)
        destination.chmod(mode)
    log(f"bcm: initramfs: busybox, {len(modules)} modules for {kver}")
    script = 'find . -print0 | LC_ALL=C sort -z | cpio --null --create --format=newc --owner=0:0 --quiet | gzip -9n > "$1"'
    _run(
        ["sh", "-c", script, "pack", str(out)],
        what="initramfs: cpio",
        log=log,
        timeout_s=deadline.left("cpio"),
        cwd=root,
    )


def _dpkg_packages(tree: Path, deadline: _Deadline) -> dict[str, str]:
    lines = _run(
        [
            "dpkg-query",
            f"--admindir={tree}/var/lib/dpkg",
            "-W",
            "-f",
            "${db:Status-Abbrev}\t${Package}\t${Version}\n",
        ],
        what="dpkg-query",
        log=lambda _: None,
        timeout_s=deadline.left("dpkg-query"),
    )
    packages = {}
    for line in lines:
        parts = line.split("\t")
        if len(parts) == 3 and parts[0].startswith("ii"):
            packages[parts[1]] = parts[2]
    return packages


def _driver_version(tree: Path, kver: str, deadline: _Deadline) -> str | None:
    """The NVIDIA kernel module's version in the image (Debian names it nvidia-current), or None."""
    modinfo = tree / "sbin/modinfo"
    if not (modinfo.exists() or modinfo.is_symlink()):
        return None
    for module in ("nvidia-current", "nvidia"):
        try:
            lines = _run(
                ["chroot", str(tree), "/sbin/modinfo", "-k", kver, "-F", "version", module],
                what="modinfo",
                log=lambda _: None,
                timeout_s=min(60, deadline.left("modinfo")),
                env=CHROOT_ENV,
            )
        except FatalDriverError:
            continue
        versions = [line.strip() for line in lines if line.strip()]
        if versions:
            return versions[0]
    return None


def _artifact(kind: str, staging: Path) -> Artifact:
    path = staging / ARTIFACT_FILES[kind]
    return Artifact(kind=kind, filename=path.name, size=path.stat().st_size, sha256=_sha256(path))


def ensure_tree(chain: list[Recipe], cache_dir: Path, log: Log, timeout_s: float = 3600) -> Path:
    """The top layer's tree of a chain, built (or reused from the cache) but not packed: what the lab runs."""
    tree, _keys = _ensure_layers(chain, cache_dir, log, lambda f: None, _Deadline(timeout_s), share=1.0)
    return tree


def build(
    chain: list[Recipe],
    cache_dir: Path,
    staging: Path,
    log: Log,
    progress: Progress = lambda f: None,
    timeout_s: float = 3600,
) -> BuildResult:
    """Build (or reuse) the chain's layers, then pack the top one into ``staging`` (new or empty)."""
    if staging.exists() and (not staging.is_dir() or any(staging.iterdir())):
        raise InvalidInput(f"staging directory {staging} exists and is not empty", field="staging")
    deadline = _Deadline(timeout_s)
    tree, keys = _ensure_layers(chain, cache_dir, log, progress, deadline, share=0.8)
    staging.mkdir(parents=True, exist_ok=True)
    try:
        return _pack(chain, keys, tree, cache_dir, staging, log, progress, deadline)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _pack(
    chain: list[Recipe],
    keys: list[str],
    tree: Path,
    cache_dir: Path,
    staging: Path,
    log: Log,
    progress: Progress,
    deadline: _Deadline,
) -> BuildResult:
    kver = kernel_version(tree)
    shutil.copyfile(tree / "boot" / f"vmlinuz-{kver}", staging / ARTIFACT_FILES["kernel"])
    work = cache_dir / "work" / staging.name
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    try:
        _pack_initramfs(tree, kver, staging / ARTIFACT_FILES["initramfs"], work, log, deadline)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    progress(0.85)
    log("bcm: rootfs.squashfs: mksquashfs (zstd)")
    argv = [
        "mksquashfs",
        str(tree),
        str(staging / ARTIFACT_FILES["rootfs"]),
        "-comp",
        "zstd",
        "-Xcompression-level",
        "3",
        "-noappend",
        "-no-progress",
        "-quiet",
        "-wildcards",
        "-e",
        *SQUASHFS_EXCLUDE,
    ]
    _run(argv, what="mksquashfs", log=log, timeout_s=deadline.left("mksquashfs"))
    progress(0.95)
    packages = _dpkg_packages(tree, deadline)
    artifacts = [_artifact(kind, staging) for kind in ("kernel", "initramfs", "rootfs")]
    manifest = {
        "builder_version": BUILDER_VERSION,
        "recipes": [recipe.name for recipe in chain],
        "layer_keys": keys,
        "kernel_version": kver,
        "driver_version": _driver_version(tree, kver, deadline),
        "cuda_version": packages.get("nvidia-cuda-toolkit"),
        "packages": packages,
        "artifacts": [asdict(artifact) for artifact in artifacts],
        "built_at": _now(),
    }
    (staging / ARTIFACT_FILES["manifest"]).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    artifacts.append(_artifact("manifest", staging))
    progress(1.0)
    log(f"bcm: image {chain[-1].name}: packed into {staging}")
    return BuildResult(staging=staging, artifacts=artifacts, manifest=manifest)


def verify(staging: Path, artifacts: list[Artifact]) -> None:
    """Check the files in ``staging`` against ``artifacts``; FatalDriverError names the first that differs."""
    kinds = {artifact.kind for artifact in artifacts}
    for needed in ("kernel", "rootfs"):
        if needed not in kinds:
            raise FatalDriverError(f"image in {staging}: no {needed} artifact listed")
    for artifact in artifacts:
        path = staging / artifact.filename
        label = f"{artifact.kind} ({artifact.filename})"
        if not path.is_file():
            raise FatalDriverError(f"image in {staging}: {label} is missing")
        size = path.stat().st_size
        if size != artifact.size:
            raise FatalDriverError(f"image in {staging}: {label} is {size} bytes, recorded {artifact.size}")
        digest = _sha256(path)
        if digest != artifact.sha256:
            raise FatalDriverError(
                f"image in {staging}: {label} sha256 is {digest}, recorded {artifact.sha256}"
            )
    manifest_path = staging / ARTIFACT_FILES["manifest"]
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        raise FatalDriverError(
            f"image in {staging}: manifest ({manifest_path.name}) unreadable: {exc}"
        ) from exc
    if not isinstance(manifest, dict) or not manifest.get("kernel_version"):
        raise FatalDriverError(f"image in {staging}: manifest ({manifest_path.name}) has no kernel_version")


_INST = re.compile(r"^Inst (\S+) (?:\[[^\]]*\] )?\((\S+)")


def resolve(chain: list[Recipe], cache_dir: Path, packages: list[str], log: Log) -> dict[str, str]:
    """{package: version} for everything ``apt-get install --simulate packages`` would install on the chain's tree."""
    if not packages:
        return {}
    bad = [p for p in packages if not re.fullmatch(r"[a-z0-9][a-z0-9+.-]+", p)]
    if bad:
        raise InvalidInput(f"{bad[0]!r} is not a Debian package name", field="packages")
    deadline = _Deadline(3600)
    tree, keys = _ensure_layers(chain, cache_dir, log, lambda f: None, deadline, share=1.0)
    scratch = cache_dir / "work" / f"resolve-{os.getpid()}-{threading.get_ident()}"
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    script = (
        f"apt-get {APT_OPTIONS} update >/dev/null && "
        f"apt-get {APT_OPTIONS} install --simulate --no-install-recommends {' '.join(packages)}"
    )
    try:
        argv = [
            "unshare",
            "--mount",
            "--fork",
            "sh",
            "-c",
            _OVERLAY_WRAPPER,
            "bcm-resolve",
            str(tree),
            str(scratch),
            script,
        ]
        lines = _run(
            argv,
            what="apt-get install --simulate",
            log=log,
            timeout_s=min(600, deadline.left("resolve")),
            env=CHROOT_ENV,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    versions: dict[str, str] = {}
    for line in lines:
        match = _INST.match(line)
        if match:
            versions[match.group(1)] = match.group(2)
    return versions
