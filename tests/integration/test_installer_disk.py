"""The installer of the image's init (#30) on a real block device: a loop device over a sparse 8 GiB file, the
`disk` image built by `bcm image build disk`, the init's own install code (templates/image/init, run by busybox
as the initramfs runs it, in a private mount namespace) with the image's sfdisk, mkfs, rsync and grub-install.

Only the network is stood in for (the plan comes from bcm's renderer, the reports are printed): a real boot of
the same code on a VM is tests/lab/test_install.py. Checked: a full install (partitions, ext4, swap, xfs, fstab,
GRUB in the MBR, /etc/bcm-installed), an ``auto`` sync after one file changed (only its bytes written, node-local
files and the data filesystem kept), and a sync cut short (the disk's marker says so) that the next ``auto``
installs in full.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bcm.devserver import REPO, Server
from bcm.domain import disk_layout as dl

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("losetup"), reason="needs root and losetup"
)

LAYOUT = {
    "disks": [
        {
            "path": "/dev/LOOP",
            "partitions": [
                {"size": "4G", "mount": "/"},
                {"size": "256M", "fs": "swap"},
                {"size": "rest", "fs": "xfs", "mount": "/scratch"},
            ],
        }
    ]
}
HARNESS = """\
fail() {{ echo "bcm-init: FAIL $*"; exit 1; }}
wget() {{ out=""; while [ $# -gt 0 ]; do case "$1" in -O) out="$2"; shift 2;; *) last="$1"; shift;; esac; done
  case "$last" in *plan*) cp {work}/plan "$out";; *initrd*) cp {image}/initramfs.img "$out";; *) return 1;; esac; }}
install_url=http://bcm/plan; initrd_url=http://bcm/initrd; overlay_url=""; server_url=http://bcm; token=t
boot_mac=52:54:00:1a:00:01
rm -f {work}/image/plan  # each boot's /image is a new tmpfs: no plan of an earlier boot
. {work}/installer.sh
post_json() {{ echo "POST $1 $2"; }}
install_disk
"""


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The disk image's artifacts, built through bcm (layers cached under /var/cache/bcm/images)."""
    if shutil.which("mmdebstrap") is None:
        pytest.skip("needs mmdebstrap for image builds")
    srv = Server(tmp_path_factory.mktemp("installer") / "state")
    srv.start()
    try:
        done = subprocess.run(
            [*srv.argv, "image", "build", "disk"],
            env=srv.env(),
            cwd=srv.cwd,
            capture_output=True,
            text=True,
            timeout=3000,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        yield next((srv.state_dir / "images" / "disk").glob("*/rootfs.squashfs")).parent
    finally:
        srv.stop()


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[str]:
    backing = tmp_path / "disk.img"
    with open(backing, "wb") as f:
        f.truncate(8 << 30)
    dev = subprocess.run(
        ["losetup", "-f", "--show", "-P", str(backing)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=False, timeout=30)


def install(work: Path, image: Path, loop: str, mode: str) -> str:
    """Run the init's install_disk with ``mode``'s plan for ``loop``; its console output."""
    layout = dl.parse_layout({"disks": [{**LAYOUT["disks"][0], "path": loop}]})
    (work / "plan").write_text(
        dl.render_plan(
            layout,
            dl.choose_disks(layout, None),
            mode=mode,
            image="disk:1",
            server_url="http://bcm",
            mac="52:54:00:1a:00:01",
        )
    )
    lower = work / "lower"
    init = (REPO / "templates/image/init").read_text()
    body = init[init.index("# ---- install to disk") : init.index('[ -n "$install_url" ] && install_disk')]
    # the initramfs's paths moved under ``work``; the root image stays mounted; no switch_root on this machine
    body = (
        body.replace("/lower", str(lower))
        .replace("/image/", f"{work}/image/")
        .replace("/newroot", f"{work}/newroot")
    )
    body = body.replace(f"umount {lower} && umount /image", "true").replace(
        f"exec switch_root {work}/newroot /sbin/init", "echo BOOT; return 0"
    )
    (work / "installer.sh").write_text(body)
    (work / "harness.sh").write_text(HARNESS.format(work=work, image=image))
    script = (
        f"mount -t squashfs -o ro,loop {image}/rootfs.squashfs {lower} && mkdir -p {work}/image {work}/newroot"
        f" && /bin/busybox sh {work}/harness.sh"
    )
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=1200, check=False
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "FAIL" not in out and "BOOT" in out, out[-3000:]
    return out


def on_disk(loop: str, work: Path, script: str) -> str:
    """Run ``script`` with the installed root at $R (and /scratch at $R/scratch), in a private mount namespace."""
    r = work / "check"
    r.mkdir(exist_ok=True)
    done = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            f"mount {loop}p2 {r} && mount {loop}p4 {r}/scratch && R={r} && {script}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_full_then_auto_sync_and_a_cut_sync(image: Path, loop: str, tmp_path: Path) -> None:
    (tmp_path / "lower").mkdir()
    out = install(tmp_path, image, loop, "full")
    written = int(out.split("bcm-init: full: ")[1].split()[0])
    assert written > 300 << 20, out  # the whole image
    assert '"mode":"full"' in out and f'"bytes_written":{written}' in out
    seen = on_disk(
        loop,
        tmp_path,
        "cat $R/etc/bcm-installed $R/etc/fstab $R/boot/grub/grub.cfg; ls $R/boot/bcm; ls $R/usr/sbin/sfdisk",
    )
    assert "state=complete" in seen and "mode=full" in seen and f"{loop}p4 /scratch xfs" in seen, seen
    assert (
        f"bcm.disk={loop}p2" in seen
        and "initrd.img" in seen
        and "vmlinuz" in seen
        and "bcm.token" not in seen
    )
    with open(loop, "rb") as disk:
        assert b"GRUB" in disk.read(512)  # the boot code grub-install wrote to the MBR

    # one file differs from the image; node-local files and the data filesystem must stay as they are
    on_disk(
        loop,
        tmp_path,
        "rm $R/usr/lib/os-release && mkdir -p $R/etc/bcm && echo t > $R/etc/bcm/agent.json"
        " && echo results > $R/scratch/results",
    )
    out = install(tmp_path, image, loop, "auto")
    written = int(out.split("bcm-init: auto: ")[1].split()[0])
    seen = on_disk(
        loop,
        tmp_path,
        "stat -c %s $R/usr/lib/os-release; cat $R/etc/bcm/agent.json $R/scratch/results $R/etc/bcm-installed",
    )
    lines = seen.split()
    assert written == int(lines[0]), (written, seen)  # only the changed file crossed onto the disk
    assert lines[1:3] == ["t", "results"] and "mode=auto" in seen, seen

    # a sync cut short leaves the marker at "syncing": the next auto installs in full
    on_disk(loop, tmp_path, "sed -i s/^state=complete$/state=syncing/ $R/etc/bcm-installed")
    out = install(tmp_path, image, loop, "auto")
    assert "full install" in out and "bcm-init: full: " in out, out
