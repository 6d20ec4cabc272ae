"""Install to disk on a real qemu VM (#30), through documented commands only: `bcm image build disk`, a category
with `install --mode full` and a disk layout, `bcm lab up --vms 1 --disk 8G`, `bcm pxe enable`, then

The README's layout and its three blocks of commands for the lab run verbatim, and between them:

1. `bcm node provision`: the VM network-boots, its init partitions the 8 GiB virtio disk (sfdisk from the
   image), makes ext4, swap and xfs and starts copying the image: the VM is killed there (`bcm lab vm-power cycle
   --pxe`, the plug pulled); its next boot installs again, writes fstab and GRUB, reports ``installed`` and boots
   the disk's system, which calls back: booted, from disk, the image and version recorded on the disk and in bcm;
2. a layout bigger than the disk its SSH inventory found: a 422 naming the partition, before anything runs;
3. `nosync`, `bcm node reimage --wait`: iPXE's ``local`` purpose boots the disk (GRUB, bcm's initramfs mounts the
   root): the system calls back with its stored agent token, and bcm's /metrics count no kernel, initramfs or root
   image fetched for that boot;
4. `auto` onto version 2 of the image (the recipe, copied under ``BCM_IMAGES__RECIPES_DIR``, adds one file):
   the initramfs fetches only the delta (kilobytes, counted in /metrics), not the root image, applies it with
   busybox and boots the disk's version 2, where the new file is (SSH with bcm's key, the pinned host key);
5. the node marked a data node: `--mode full` is refused with one line naming `--confirm-wipe`, nothing stored.

The data node's confirmation and the plan/report protocol are in tests/api/test_install_api.py (API level).
Run under `flock /tmp/bcm-lab.lock` (fixed lab name and subnet).
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bcm.devserver import REPO
from tests.lab.test_health_e2e import until
from tests.lab.test_readme import README
from tests.lab.test_zero_touch import Flow, flow_at

pytestmark = pytest.mark.lab

README_TEXT = README.read_text()
# the README's layout.yaml and its three blocks of commands, run here verbatim
_LAYOUT = re.search(r"^A layout, `layout.yaml`.*?^```yaml\n(.*?)^```", README_TEXT, re.MULTILINE | re.DOTALL)
LAYOUT = _LAYOUT[1] if _LAYOUT else ""
BLOCKS = [
    [ln for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    for block in re.findall(
        r"^<!-- run verbatim by tests/lab/test_install\.py[^\n]*-->\n```sh\n(.*?)^```",
        README_TEXT,
        re.MULTILINE | re.DOTALL,
    )
]
TOO_BIG = LAYOUT.replace("size: 256M", "size: 5G")


CHANGED = """\
files:
  - path: /etc/bcm-lab-changed
    content: |
      the one file version 2 of the disk image adds
"""


@pytest.fixture
def flow(tmp_path: Path, lab_required: None) -> Iterator[Flow]:
    """tests/lab/test_zero_touch.py's flow, its server reading recipes from a copy of images/
    (``BCM_IMAGES__RECIPES_DIR``, as a site that changes a recipe does)."""
    recipes = tmp_path / "recipes"
    shutil.copytree(REPO / "images", recipes)
    with flow_at(tmp_path, {"BCM_IMAGES__RECIPES_DIR": str(recipes)}) as f:
        yield f


def metrics(f: Flow) -> str:
    return subprocess.run(
        ["curl", "-sf", "-H", f"Authorization: Bearer {f.server.token()}", f"{f.server.url}/metrics"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout


def fetches(f: Flow) -> dict[str, float]:
    """bcm's boot-artifact downloads so far, by kind (/metrics, with the admin token)."""
    found = dict(
        re.findall(r'^bcm_boot_artifact_fetches_total\{kind="(\w+)"\} (\S+)$', metrics(f), re.MULTILINE)
    )
    return {k: float(v) for k, v in found.items()}


def delta_bytes(f: Flow) -> float:
    m = re.search(r"^bcm_image_delta_bytes_total (\S+)$", metrics(f), re.MULTILINE)
    assert m, "bcm_image_delta_bytes_total is not in /metrics"
    return float(m.group(1))


def refused_by_bcm(f: Flow, line: str) -> subprocess.CompletedProcess[str]:
    """``line`` run as the flow runs its commands, for one that must fail (exit and stderr returned)."""
    return subprocess.run(
        ["bash", "-c", line],
        cwd=f.work,
        env=f.server.env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def ssh_vm(f: Flow, command: str) -> str:
    """``command`` on vm01 over SSH with bcm's key, its host key the one bcm pinned."""
    with sqlite3.connect(f.server.state_dir / "bcm.db") as db:
        pin = db.execute("SELECT ssh_host_key FROM node WHERE name = 'vm01'").fetchone()[0]
    ip = f.json("node", "show", "vm01")["interfaces"][0]["ip"]
    known = f.work / "kh-vm01"
    known.write_text(f"{ip} {pin}\n")
    done = subprocess.run(
        [
            "ssh",
            "-i",
            str(f.server.state_dir / "ssh" / "id_ed25519"),
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            f"UserKnownHostsFile={known}",
            "-o",
            "ConnectTimeout=10",
            f"root@{ip}",
            command,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def serial(f: Flow) -> str:
    """The VM's console since its last power-on (qemu opens the log anew at each start)."""
    log = f.server.state_dir / "lab" / "bcmlab" / "vms" / "vm01" / "serial.log"
    return log.read_text(errors="replace")[-20000:] if log.exists() else "(no serial log)"


@pytest.mark.timeout(3600)
def test_full_install_then_boot_from_disk_fetching_nothing(flow: Flow) -> None:  # noqa: F811
    f = flow
    assert len(BLOCKS) == 3 and "size: 256M" in LAYOUT, (BLOCKS, LAYOUT)
    (f.work / "layout.yaml").write_text(LAYOUT)
    (f.work / "big.yaml").write_text(TOO_BIG)
    for line in BLOCKS[0]:  # image, category, layout, lab, PXE, `node provision vm01`
        f.sh(line)
    assert (f.server.state_dir / "lab" / "bcmlab" / "vms" / "vm01" / "disk.qcow2").is_file()
    try:
        # the plug pulled while the image is being copied to the disk: bcm holds the disk for "installing"
        until("the install to copy the image", lambda: "bcm-init: copying" in serial(f), 1200, 2)
        assert f.json("node", "install", "vm01")["install_state"] == "installing"
        f.sh(".venv/bin/bcm lab vm-power cycle vm01 --pxe")
        # its next boot installs again (never the local purpose onto a half-written disk), then boots the disk
        f.sh(".venv/bin/bcm node wait vm01 --state booted --timeout 1800")
    except BaseException:
        print(serial(f))
        raise

    # the README's next block: show, then nosync: the next provisioning boots the disk as it is, fetching nothing
    before = fetches(f)
    for line in BLOCKS[1]:
        f.sh(line)
    node = f.json("node", "show", "vm01")
    version = f.json("image", "show", "disk")["version"]
    assert (node["install_state"], node["installed_image"]) == ("installed", f"disk:{version}"), node
    assert (node["provision_state"], node["booted_from"], node["booted_image"]) == (
        "booted",
        "disk",
        node["installed_image"],
    ), node
    assert node["install_bytes"] and node["install_bytes"] > 100 << 20, (
        node
    )  # the image crossed onto the disk
    disks = {d["name"]: d for d in node["hardware"]["facts"]["disks"]}
    assert disks["vda"]["size_bytes"] == 8 << 30, disks
    assert fetches(f) == before, (before, fetches(f))
    # this boot's console: bcm's initramfs mounted the disk's root (GRUB's bcm.disk=) and fetched nothing
    console = serial(f)
    assert "booting the system installed on /dev/vda2" in console and "bcm-init: fetching" not in console, (
        console
    )
    f.sh(".venv/bin/bcm node wait vm01 --state booted --inventoried --idle --timeout 600")
    mounted = ssh_vm(f, "findmnt -n -o FSTYPE /scratch").strip()
    assert mounted == "xfs", mounted  # the layout's other filesystem, made and mounted
    print(json.dumps({k: node[k] for k in ("installed_image", "install_bytes", "booted_from")}))

    # a layout bigger than the inventoried disk: refused before anything runs, the field named
    done = refused_by_bcm(f, ".venv/bin/bcm category install inst --layout big.yaml")
    assert done.returncode != 0 and "disk_layout.disks[0].partitions[1].size" in done.stderr, done.stderr
    assert f.json("category", "install", "inst")["disk_layout"]["disks"][0]["partitions"][1]["size"] == "256M"

    # auto onto a new version of the image that adds one file: only the changes cross the wire (a delta of
    # kilobytes, counted in /metrics); neither the root image nor a chroot is needed; the disk boots version 2
    recipe = f.server.state_dir.parent / "recipes" / "disk.yaml"
    recipe.write_text(recipe.read_text() + CHANGED)
    before, sent_before = fetches(f), delta_bytes(f)
    try:
        for line in BLOCKS[2]:  # build version 2, --mode auto, reimage, wait; then --data-node
            f.sh(line)
    except BaseException:
        print(serial(f))
        raise
    new_version = f.json("image", "show", "disk")["version"]
    assert new_version != version
    node = f.json("node", "show", "vm01")
    console = serial(f)
    assert (node["installed_image"], node["booted_from"], node["booted_image"]) == (
        f"disk:{new_version}",
        "disk",
        f"disk:{new_version}",
    ), node
    after, sent = fetches(f), delta_bytes(f) - sent_before
    assert after["rootfs"] == before["rootfs"], (before, after)  # the root image did not cross the wire
    assert after["delta"] == before["delta"] + 1, (before, after)
    assert 0 < sent < 1 << 20 and node["install_bytes"] == sent, (sent, node["install_bytes"])
    assert "bcm-init: auto: applied" in console and "bcm-init: fetching http" not in console, console
    assert ssh_vm(f, "cat /etc/bcm-lab-changed") == "the one file version 2 of the disk image adds\n"
    assert f"image=disk:{new_version}" in ssh_vm(f, "cat /etc/bcm-installed")
    print(f"auto disk:{version} → disk:{new_version}: {sent:.0f} bytes over the wire")

    # a data node (the README's last line): a full install is refused with one line naming the confirmation
    refused = refused_by_bcm(f, ".venv/bin/bcm node install vm01 --mode full")
    assert refused.returncode != 0 and "data node" in refused.stderr and "--confirm-wipe" in refused.stderr, (
        refused.stderr
    )
    settings = f.json("node", "install", "vm01")
    assert (settings["install_mode"], settings["data_node"], settings["wipe_confirmed"]) == (
        "auto",
        True,
        False,
    )
