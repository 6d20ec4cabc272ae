"""Install to disk on a real qemu VM (#30), through documented commands only: `bcm image build disk`, a category
with `install --mode full` and a disk layout, `bcm lab up --vms 1 --disk 8G`, `bcm pxe enable`, then

1. `bcm node provision`: the VM network-boots, its init partitions the 8 GiB virtio disk (sfdisk from the
   image), makes ext4 and swap and starts copying the image: the VM is killed there (`bcm lab vm-power cycle
   --pxe`, the plug pulled); its next boot installs again, writes fstab and GRUB, reports ``installed`` and boots
   the disk's system, which calls back: booted, from disk, the image and version recorded on the disk and in bcm;
2. a layout bigger than the disk its SSH inventory found: a 422 naming the partition, before anything runs;
3. `nosync`, `bcm node reimage --wait`: iPXE's ``local`` purpose boots the disk (GRUB, bcm's initramfs mounts the
   root): the system calls back with its stored agent token, and bcm's /metrics count no kernel, initramfs or root
   image fetched for that boot.

The data node's refusal and the plan/report protocol are in tests/api/test_install_api.py (API level).
Run under `flock /tmp/bcm-lab.lock` (fixed lab name and subnet).
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.lab.test_health_e2e import until
from tests.lab.test_zero_touch import Flow, flow  # noqa: F401 - fixture

pytestmark = pytest.mark.lab

LAYOUT = """\
disks:
  - path: /dev/vda
    partitions:
      - {size: 4G, mount: /}
      - {size: 256M, fs: swap}
      - {size: rest, mount: /scratch}
"""
TOO_BIG = LAYOUT.replace("size: 256M", "size: 5G")


def fetches(f: Flow) -> dict[str, float]:
    """bcm's boot-artifact downloads so far, by kind (/metrics, with the admin token)."""
    out = subprocess.run(
        ["curl", "-sf", "-H", f"Authorization: Bearer {f.server.token()}", f"{f.server.url}/metrics"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    found = dict(re.findall(r'^bcm_boot_artifact_fetches_total\{kind="(\w+)"\} (\S+)$', out, re.MULTILINE))
    return {k: float(v) for k, v in found.items()}


def serial(f: Flow) -> str:
    """The VM's console since its last power-on (qemu opens the log anew at each start)."""
    log = f.server.state_dir / "lab" / "bcmlab" / "vms" / "vm01" / "serial.log"
    return log.read_text(errors="replace")[-20000:] if log.exists() else "(no serial log)"


@pytest.mark.timeout(3600)
def test_full_install_then_boot_from_disk_fetching_nothing(flow: Flow) -> None:  # noqa: F811
    f = flow
    (f.work / "layout.yaml").write_text(LAYOUT)
    (f.work / "big.yaml").write_text(TOO_BIG)
    f.sh(".venv/bin/bcm image build disk")
    f.sh(".venv/bin/bcm category add inst --image disk")
    f.sh(".venv/bin/bcm category install inst --mode full --layout layout.yaml")
    f.sh(".venv/bin/bcm lab up --nodes 0 --gpus 0 --vms 1 --disk 8G --category inst")
    assert (f.server.state_dir / "lab" / "bcmlab" / "vms" / "vm01" / "disk.qcow2").is_file()
    f.sh(
        ".venv/bin/bcm pxe enable --interface bcmlab-prov --address 198.18.0.1 --range 198.18.0.100-198.18.0.150"
    )
    f.sh(".venv/bin/bcm node provision vm01")
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
    f.sh(".venv/bin/bcm node wait vm01 --state booted --inventoried --idle --timeout 600")
    node = f.json("node", "show", "vm01")
    version = f.json("image", "show", "disk")["version"]
    assert (node["install_state"], node["installed_image"]) == ("installed", f"disk:{version}"), node
    assert (node["booted_from"], node["booted_image"]) == ("disk", node["installed_image"]), node
    assert node["install_bytes"] and node["install_bytes"] > 100 << 20, (
        node
    )  # the image crossed onto the disk
    disks = {d["name"]: d for d in node["hardware"]["facts"]["disks"]}
    assert disks["vda"]["size_bytes"] == 8 << 30, disks

    # a layout bigger than the inventoried disk: refused before anything runs, the field named
    done = subprocess.run(
        ["bash", "-c", ".venv/bin/bcm category install inst --layout big.yaml"],
        cwd=f.work,
        env=f.server.env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0 and "disk_layout.disks[0].partitions[1].size" in done.stderr, done.stderr
    assert f.json("category", "install", "inst")["disk_layout"]["disks"][0]["partitions"][1]["size"] == "256M"

    # nosync: the next provisioning boots the disk as it is, fetching nothing from bcm
    before = fetches(f)
    f.sh(".venv/bin/bcm node install vm01 --mode nosync")
    f.sh(".venv/bin/bcm node reimage vm01 --wait --timeout 900")
    node = f.json("node", "show", "vm01")
    assert (node["provision_state"], node["booted_from"]) == ("booted", "disk"), node
    assert fetches(f) == before, (before, fetches(f))
    # this boot's console: bcm's initramfs mounted the disk's root (GRUB's bcm.disk=) and fetched nothing
    console = serial(f)
    assert "booting the system installed on /dev/vda2" in console and "bcm-init: fetching" not in console, (
        console
    )
    print(json.dumps({k: node[k] for k in ("installed_image", "install_bytes", "booted_from")}))
