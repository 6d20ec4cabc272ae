"""Benchmark: install to disk (#30) on one lab VM, against its stateless boot, same VM, same image, one run.

Root; a lab (fixed name and subnet: run under `flock /tmp/bcm-lab.lock`). A `bcm serve` on a fresh state
directory, the `disk` image, a category with `install --mode full` and an 8 GiB layout, `bcm lab up --vms 1
--disk 8G`, then, each timed from the verb to `booted`:

  full:      `bcm node provision --wait`: partition, mkfs, copy the whole image, GRUB, boot the disk;
  auto:      a second version of the image with one file changed (a recipe copy with one more `files:` entry,
             under a temporary BCM_IMAGES__RECIPES_DIR), `--next auto`, `bcm node reimage --wait`: the delta's
             bytes, all that crossed the wire for the sync (`install_bytes`), and time;
  stateless: `--mode stateless`, `bcm node reimage --wait`: the image in RAM, as before #30.

Prints the three times, the bytes of the full install and of the auto sync, and the ratios; asserts nothing.
TCG VMs: minutes per boot. Usage: .venv/bin/python bench/install.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bcm.devserver import REPO, Server

LAYOUT = """\
disks:
  - path: /dev/vda
    partitions:
      - {size: 4G, mount: /}
      - {size: 256M, fs: swap}
      - {size: rest, mount: /scratch}
"""
CHANGED = """\
files:
  - path: /etc/bcm-bench-changed
    content: |
      one file changed for bench/install.py ({stamp})
"""


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="bcm-bench-install-"))
    recipes = work / "recipes"
    shutil.copytree(REPO / "images", recipes)
    server = Server(work / "state", host="0.0.0.0", extra_env={"BCM_IMAGES__RECIPES_DIR": str(recipes)})

    def bcm(*args: str, timeout: float = 3600) -> str:
        done = subprocess.run(
            [*server.argv, *args],
            env=server.env(),
            cwd=work,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            sys.exit(f"bcm {' '.join(args)} failed: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def timed(*args: str) -> float:
        start = time.monotonic()
        bcm(*args)
        return time.monotonic() - start

    def node() -> dict[str, object]:
        return dict(json.loads(bcm("node", "show", "vm01", "--json")))

    (work / "layout.yaml").write_text(LAYOUT)
    server.start()
    try:
        bcm("image", "build", "disk")
        bcm("category", "add", "bench", "--image", "disk")
        bcm("category", "install", "bench", "--mode", "full", "--layout", str(work / "layout.yaml"))
        bcm("lab", "up", "--nodes", "0", "--gpus", "0", "--vms", "1", "--disk", "8G", "--category", "bench")
        bcm(
            "pxe",
            "enable",
            "--interface",
            "bcmlab-prov",
            "--address",
            "198.18.0.1",
            "--range",
            "198.18.0.100-198.18.0.150",
        )
        full_s = timed("node", "provision", "vm01", "--wait", "--timeout", "2400")
        full = node()
        bcm("node", "wait", "vm01", "--state", "booted", "--idle", "--timeout", "600")

        disk = recipes / "disk.yaml"
        disk.write_text(disk.read_text() + CHANGED.format(stamp=time.time()))
        bcm("image", "build", "disk")
        bcm("node", "install", "vm01", "--next", "auto")
        auto_s = timed("node", "reimage", "vm01", "--wait", "--timeout", "2400")
        auto = node()
        bcm("node", "wait", "vm01", "--state", "booted", "--idle", "--timeout", "600")

        bcm("node", "install", "vm01", "--mode", "stateless")
        stateless_s = timed("node", "reimage", "vm01", "--wait", "--timeout", "2400")
        stateless = node()
    finally:
        subprocess.run(
            [*server.argv, "pxe", "disable"], env=server.env(), capture_output=True, timeout=120, check=False
        )
        subprocess.run(
            [*server.argv, "lab", "down"], env=server.env(), capture_output=True, timeout=600, check=False
        )
        server.stop()
    print(f"image {full['installed_image']} → {auto['installed_image']}, one VM (TCG), 8 GiB virtio disk")
    print(
        f"full install  {full_s:8.1f} s  {full['install_bytes']} bytes written  (booted from {full['booted_from']})"
    )
    print(
        f"auto resync   {auto_s:8.1f} s  {auto['install_bytes']} bytes of delta over the wire"
        f"  (booted from {auto['booted_from']})"
    )
    print(f"stateless     {stateless_s:8.1f} s  (booted from {stateless['booted_from']})")
    print(f"full / stateless = {full_s / stateless_s:.2f}x; auto / stateless = {auto_s / stateless_s:.2f}x")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
