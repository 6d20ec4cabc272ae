"""Image deltas (#30, an `auto` install over the wire): two real squashfs root images (mksquashfs), the delta
bcm builds from them (unsquashfs, GNU tar), applied to a copy of the old tree with Debian's static busybox the
way the image's init applies it (removals first, then ``tar -x``): the result is the new tree, file for file,
owners and modes included, but for the node's own paths, which stay as they were."""

from __future__ import annotations

import os
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from bcm.drivers import imagedelta

BUSYBOX = "/bin/busybox"
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="unsquashfs keeps owners only as root")


def tree_of(root: Path) -> dict[str, tuple[object, ...]]:
    """Every path with its type, mode, owner and content (or link target)."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = "/" + str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                body: object = os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                body = p.read_bytes()
            else:
                body = None
            out[rel] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, body)
    return out


def write(root: Path, rel: str, text: str, mode: int = 0o644, owner: tuple[int, int] = (0, 0)) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    os.chmod(p, mode)
    os.chown(p, *owner)


def squash(tree: Path, out: Path) -> Path:
    subprocess.run(["mksquashfs", str(tree), str(out), "-quiet", "-no-progress", "-noappend"], check=True)
    return out


def test_a_delta_turns_the_old_tree_into_the_new_one_but_for_the_nodes_own_paths(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    for root in (old, new):
        write(root, "usr/bin/same", "#!/bin/sh\necho same\n" * 2000, 0o755)  # unchanged, 36 KB
        write(root, "etc/hostname", "image\n")
        os.symlink("usr/bin", root / "bin")
        write(root, "srv/dir-to-file/inner", "x")
    write(old, "etc/changed.conf", "a = 1\n")
    write(new, "etc/changed.conf", "a = 2\n")  # same size, other content
    write(old, "etc/mode", "m", 0o644)
    write(new, "etc/mode", "m", 0o600)  # only the mode
    write(old, "etc/owner", "o")
    write(new, "etc/owner", "o", owner=(1000, 1000))  # only the owner
    write(old, "usr/lib/gone/a.so", "old library")  # a directory that goes whole
    write(old, "usr/lib/gone/deep/b.so", "old library")
    write(new, "usr/lib/new/c.so", "new library")
    os.symlink("old-target", old / "usr/lib/link")
    os.symlink("new-target", new / "usr/lib/link")
    # a directory in the old version is a file in the new one
    (new / "srv/dir-to-file/inner").unlink()
    (new / "srv/dir-to-file").rmdir()
    write(new, "srv/dir-to-file", "now a file")
    # the node's own paths: whatever the images hold there, the sync leaves the node's
    write(new, "etc/hostname", "changed in the image\n")
    write(new, "etc/ssh/ssh_host_ed25519_key", "image key")
    write(new, "var/log/image.log", "log")
    write(new, "scratch/file", "under a mount point of the layout")

    delta = imagedelta.build(
        squash(old, tmp_path / "old.squashfs"),
        squash(new, tmp_path / "new.squashfs"),
        tmp_path / "out" / "delta.tar.gz",
        skip=(*imagedelta.SKIP, "/scratch"),
    )
    assert delta.path.is_file() and delta.size == delta.path.stat().st_size
    assert list((tmp_path / "out").iterdir()) == [delta.path]  # no scratch trees or partial archives left
    with tarfile.open(delta.path) as tar:
        members = tar.getnames()
        removed = tar.extractfile(imagedelta.REMOVED).read().decode().splitlines()  # type: ignore[union-attr]
    assert members[0] == imagedelta.REMOVED
    sent = set(members[1:])
    assert {
        "etc/changed.conf",
        "etc/mode",
        "etc/owner",
        "usr/lib/new",
        "usr/lib/new/c.so",
        "usr/lib/link",
    } <= sent
    assert "srv/dir-to-file" in sent
    assert not sent & {
        "usr/bin/same",
        "bin",
        "etc/hostname",
        "etc/ssh/ssh_host_ed25519_key",
        "var/log/image.log",
    }
    assert not any(m.startswith("scratch") for m in sent)
    assert sorted(removed) == ["srv/dir-to-file", "usr/lib/gone"]  # the directory goes whole, listed once

    # the node: the old tree with its own hostname, applied as templates/image/init applies it
    disk = tmp_path / "disk"
    subprocess.run(["cp", "-a", str(old), str(disk)], check=True)
    write(disk, "etc/hostname", "gpu01\n")
    script = (
        f'{BUSYBOX} tar -xzf "$1" -C "$2" {imagedelta.REMOVED} && '
        f'while IFS= read -r gone; do [ -n "$gone" ] && rm -rf "$3/$gone"; done < "$2/{imagedelta.REMOVED}" && '
        f'{BUSYBOX} tar -xzf "$1" -C "$3" && rm -f "$3/{imagedelta.REMOVED}"'
    )
    work = tmp_path / "work"
    work.mkdir()
    subprocess.run([BUSYBOX, "sh", "-c", script, "sh", str(delta.path), str(work), str(disk)], check=True)

    got, want = tree_of(disk), tree_of(new)
    assert got["/etc/hostname"][4] == b"gpu01\n"  # the node's own
    for own in (
        "/etc/hostname",
        "/etc/ssh",
        "/etc/ssh/ssh_host_ed25519_key",
        "/var/log",
        "/var/log/image.log",
    ):
        got.pop(own, None)
        want.pop(own, None)
    want = {k: v for k, v in want.items() if not k.startswith("/scratch")}
    assert got.keys() == want.keys(), (got.keys() - want.keys(), want.keys() - got.keys())
    for rel in want:
        if want[rel][0] == stat.S_IFDIR:
            assert got[rel][:4] == want[rel][:4], rel
        else:
            assert got[rel] == want[rel], rel


def test_the_same_image_gives_an_empty_delta(tmp_path: Path) -> None:
    tree = tmp_path / "t"
    write(tree, "usr/bin/x", "x" * 100000, 0o755)
    sq = squash(tree, tmp_path / "a.squashfs")
    delta = imagedelta.build(sq, sq, tmp_path / "d.tar.gz")
    with tarfile.open(delta.path) as tar:
        assert tar.getnames() == [imagedelta.REMOVED]
    assert delta.size < 1024


def test_a_broken_root_image_is_a_delta_error_and_leaves_nothing(tmp_path: Path) -> None:
    tree = tmp_path / "t"
    write(tree, "a", "a")
    good = squash(tree, tmp_path / "a.squashfs")
    bad = tmp_path / "bad.squashfs"
    bad.write_bytes(b"not a squashfs" * 100)
    out = tmp_path / "out" / "d.tar.gz"
    with pytest.raises(imagedelta.DeltaError, match="unsquashfs bad.squashfs"):
        imagedelta.build(good, bad, out)
    assert list((tmp_path / "out").iterdir()) == []


def test_the_worker_builds_each_delta_once_and_remembers_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bcm.workers.deltas: nodes asking for one delta at once share one build (the real one, counted); a later
    ask finds the archive; a failed build answers the next asks at once with its reason instead of unpacking
    the images again; after stop() nothing new starts."""
    import asyncio

    from bcm.workers import deltas

    old, new = tmp_path / "old", tmp_path / "new"
    write(old, "etc/a", "1")
    write(new, "etc/a", "2")
    sq_old, sq_new = squash(old, tmp_path / "old.squashfs"), squash(new, tmp_path / "new.squashfs")
    bad = tmp_path / "bad.squashfs"
    bad.write_bytes(b"junk" * 100)
    calls: list[Path] = []
    real_build = imagedelta.build

    def counted(*args: object, **kw: object) -> imagedelta.Delta:
        calls.append(args[2])  # type: ignore[arg-type]
        return real_build(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(imagedelta, "build", counted)
    good = deltas.DeltaJob(sq_old, sq_new, tmp_path / "d" / "good.tar.gz", imagedelta.SKIP, "1 → 2")
    broken = deltas.DeltaJob(sq_old, bad, tmp_path / "d" / "bad.tar.gz", imagedelta.SKIP, "1 → bad")

    async def scenario() -> None:
        worker = deltas.Deltas()
        try:
            got = await asyncio.gather(*(worker.get(good) for _ in range(5)))
            assert len(calls) == 1 and {g.path for g in got} == {good.out} and good.out.is_file()
            assert (await worker.get(good)).size == good.out.stat().st_size and len(calls) == 1
            for _ in range(3):
                with pytest.raises(imagedelta.DeltaError, match="unsquashfs bad.squashfs"):
                    await worker.get(broken)
            assert calls.count(broken.out) == 1  # remembered, not unpacked again
        finally:
            await worker.stop()
        with pytest.raises(imagedelta.DeltaError, match="shutting down"):
            await worker.get(deltas.DeltaJob(sq_new, sq_old, tmp_path / "d" / "other.tar.gz", (), "2 → 1"))

    asyncio.run(scenario())
