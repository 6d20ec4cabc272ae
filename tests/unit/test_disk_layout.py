"""Disk layouts (#30): checked in themselves and against a node's disks, and rendered into the init's plan."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bcm.domain import disk_layout as dl
from bcm.errors import InvalidInput
from bcm.lab.errors import LabError
from bcm.lab.vm import parse_disk_size, qemu_argv

DISKS = [
    {"name": "nvme0n1", "size_bytes": 960 << 30, "model": "SAMSUNG MZ1L2960"},
    {"name": "nvme1n1", "size_bytes": 960 << 30, "model": "SAMSUNG MZ1L2960"},
    {"name": "sda", "size_bytes": 240 << 30, "model": "INTEL SSDSC2KB240"},
]
RAID = {
    "disks": [
        {"model": "INTEL", "partitions": [{"size": "100G", "mount": "/"}, {"size": "rest", "fs": "swap"}]},
        {"model": "SAMSUNG", "partitions": [{"size": "rest", "fs": "raid"}]},
        {"model": "SAMSUNG", "partitions": [{"size": "rest", "fs": "raid"}]},
    ],
    "raid": [
        {
            "name": "md0",
            "members": ["disks[1].partitions[0]", "disks[2].partitions[0]"],
            "fs": "xfs",
            "mount": "/data",
        }
    ],
}


def test_disks_chosen_by_model_and_size_and_a_raid_plan_that_sh_parses(tmp_path: Path) -> None:
    layout = dl.parse_layout(RAID)
    chosen = dl.choose_disks(layout, DISKS)
    assert [c.device for c in chosen] == ["/dev/sda", "/dev/nvme0n1", "/dev/nvme1n1"]
    plan = dl.render_plan(layout, chosen, mode="full", image="disk:3", server_url="http://h", mac="m")
    assert "--raid-devices=2 /dev/nvme0n1p2 /dev/nvme1n1p2" in plan and "T mkfs.xfs -q -f /dev/md0" in plan
    assert "/dev/md0 /data xfs defaults 0 0" in plan and "BCM_ROOT=/dev/sda2" in plan
    (tmp_path / "plan").write_text(plan + 'printf "%s|%s" "$BCM_MODE" "$BCM_GRUB_DISKS"\n')
    done = subprocess.run(
        ["sh", str(tmp_path / "plan")], capture_output=True, text=True, timeout=10, check=True
    )
    assert done.stdout == "full|/dev/sda /dev/nvme0n1 /dev/nvme1n1"
    by_size = dl.parse_layout(
        {"disks": [{"min_size": "500G", "partitions": [{"size": "rest", "mount": "/"}]}]}
    )
    assert [c.device for c in dl.choose_disks(by_size, DISKS)] == ["/dev/nvme0n1"]


@pytest.mark.parametrize(
    ("layout", "field"),
    [
        (
            {"disks": [{"path": "/dev/sda", "partitions": [{"size": "rest", "mount": "/", "fs": "swap"}]}]},
            "disk_layout.disks[0].partitions[0].mount",
        ),
        (
            {
                "disks": [
                    {
                        "path": "/dev/sda",
                        "partitions": [{"size": "1G", "mount": "/"}, {"size": "1G", "mount": "/"}],
                    }
                ]
            },
            "disk_layout.disks[0].partitions[1].mount",
        ),
        ({"disks": [{"partitions": [{"size": "1G", "mount": "/"}]}]}, "disk_layout.disks[0]"),
        (
            {
                "disks": [{"path": "/dev/sda", "partitions": [{"size": "1G", "mount": "/"}]}],
                "raid": [{"name": "md0", "members": ["disks[0].partitions[5]", "disks[0].partitions[0]"]}],
            },
            "disk_layout.raid[0].members[0]",
        ),
        (
            {"disks": [{"path": "/dev/sda", "partitions": [{"size": "99999999G", "mount": "/"}]}]},
            "disk_layout.disks[0].partitions[0].size",
        ),
        (
            {"disks": [{"path": "/dev/sda", "partitions": [{"size": "1G", "mount": "/"}]}], "extra": 1},
            "disk_layout.extra",
        ),
        ({"disks": []}, "disk_layout.disks"),
    ],
)
def test_bad_layouts_name_the_field(layout: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidInput) as exc:
        dl.parse_layout(layout)
    assert exc.value.field == field, exc.value.message


def test_a_partition_that_does_not_fit_is_named() -> None:
    layout = dl.parse_layout(
        {
            "disks": [
                {
                    "path": "/dev/sda",
                    "partitions": [
                        {"size": "200G", "mount": "/"},
                        {"size": "40G", "fs": "swap"},
                        {"size": "rest", "mount": "/tmp"},
                    ],
                }
            ]
        }
    )
    with pytest.raises(InvalidInput) as exc:
        dl.choose_disks(layout, DISKS)
    assert exc.value.field == "disk_layout.disks[0].partitions[1].size" and "/dev/sda" in exc.value.message


def test_lab_vm_disks() -> None:
    assert parse_disk_size("8G") == 8 << 30 and parse_disk_size("512M") == 512 << 20
    for bad in ("8", "8T", "1M", "65G", "-1G"):
        with pytest.raises(LabError):
            parse_disk_size(bad)
    argv = qemu_argv("vm01", "tapvm1", "52:54:00:1a:00:01", disk=Path("/lab/vm01/disk.qcow2"))
    assert "file=/lab/vm01/disk.qcow2,format=qcow2,if=virtio,cache=unsafe" in argv
    assert not any("disk.qcow2" in a for a in qemu_argv("vm01", "tapvm1", "52:54:00:1a:00:01"))
