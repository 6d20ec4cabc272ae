"""Install to disk (#30): install modes, disk layouts as data, their check against a node's inventoried disks,
and the plan the image's init runs (rendered by bcm, one shell script per boot).

Install modes, with Base Command Manager's meanings:

- ``stateless`` (default): the node boots its image from the network into RAM every time (bcm's model so far);
- ``full``: partition the disks, make the filesystems, copy the image, install the boot loader, every
  provisioning of the node;
- ``auto``: check the disks against the layout: repartition only when they differ (or nothing complete is
  installed), otherwise sync only what changed (rsync, bytes counted);
- ``nosync``: boot what is installed as it is (a node with nothing installed gets a ``full`` install).

A layout names disks by ``path`` (``/dev/vda``), ``model`` (a substring of the inventoried model) or
``min_size`` (the smallest inventoried disk at least that big); each gets GPT partitions with a ``size``
(``512M``, ``20G``, ``1T``) or ``rest`` (the last one only), a filesystem (``ext4``, ``xfs``, ``swap``,
``raid`` for a RAID-1 member, ``none``) and a mount point. ``raid`` pairs partitions into mdadm RAID-1 arrays.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from bcm.errors import InvalidInput

INSTALL_MODES = ("stateless", "full", "auto", "nosync")
MAX_DISKS = 16
MAX_PARTITIONS = 32
MAX_RAID = 8
MIB = 1 << 20
UNITS = {"M": MIB, "G": 1 << 30, "T": 1 << 40}
SIZE_RE = re.compile(r"([1-9][0-9]{0,6})([MGT])")
# GPT and the BIOS boot partition (1 MiB at 1 MiB) that bcm adds to each disk GRUB goes on; sfdisk aligns
# partitions to 1 MiB, so each one may lose up to a MiB: counted as overhead
GPT_OVERHEAD = 3 * MIB
BIOS_GRUB = "21686148-6449-6E6F-744E-656564454649"
FIRST_PARTITION = 2  # partitions[0] of a layout disk; 1 is the BIOS boot partition
LINUX_FS = "0FC63DAF-8483-4772-8E79-3D69D8477DE4"
LINUX_SWAP = "0657FD6D-A4AB-43C4-84E5-0933C84B4F4F"
LINUX_RAID = "A19D880F-05FC-4D3B-A006-743F0F84911E"


def check_install_mode(value: str | None, field: str = "install_mode") -> str | None:
    if value is not None and value not in INSTALL_MODES:
        raise InvalidInput(f"{field}: {value[:16]!r} is not one of {', '.join(INSTALL_MODES)}", field=field)
    return value


def parse_size(value: str) -> int:
    m = SIZE_RE.fullmatch(value)
    if not m:
        raise ValueError(f"{value[:16]!r} is not a size (like 512M, 20G, 1T) or rest")
    return int(m.group(1)) * UNITS[m.group(2)]


def _check_mount(v: str | None) -> str | None:
    if v is not None and not re.fullmatch(r"/([A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*)?", v):
        raise ValueError(f"{v[:64]!r} is not an absolute path (letters, digits, . _ -)")
    return v


class PartitionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    size: str = Field(min_length=1, max_length=16, description="512M, 20G, 1T, or rest (the last partition)")
    fs: Literal["ext4", "xfs", "swap", "raid", "none"] = "ext4"
    mount: str | None = Field(default=None, min_length=1, max_length=255)

    @field_validator("size")
    @classmethod
    def _size(cls, v: str) -> str:
        if v != "rest":
            parse_size(v)
        return v

    @field_validator("mount")
    @classmethod
    def _mount(cls, v: str | None) -> str | None:
        return _check_mount(v)


class DiskSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(
        default=None, max_length=64, description="/dev/vda, /dev/nvme0n1, /dev/disk/by-id/…"
    )
    model: str | None = Field(
        default=None, min_length=1, max_length=64, description="a substring of the model"
    )
    min_size: str | None = Field(
        default=None, max_length=16, description="the smallest disk at least this big"
    )
    partitions: list[PartitionSpec] = Field(min_length=1, max_length=MAX_PARTITIONS)

    @field_validator("path")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"/dev/[A-Za-z0-9_.:-]+(/[A-Za-z0-9_.:-]+)*", v):
            raise ValueError(f"{v[:64]!r} is not a device path under /dev")
        return v

    @field_validator("model")
    @classmethod
    def _model(cls, v: str | None) -> str | None:
        if v is not None and not all(c.isprintable() for c in v):
            raise ValueError("printable characters only")
        return v

    @field_validator("min_size")
    @classmethod
    def _min_size(cls, v: str | None) -> str | None:
        if v is not None:
            parse_size(v)
        return v


class RaidSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^md[0-9]{1,3}$", max_length=5)
    level: Literal[1] = 1
    members: list[str] = Field(min_length=2, max_length=8, description='"disks[0].partitions[1]"')
    fs: Literal["ext4", "xfs", "swap"] = "ext4"
    mount: str | None = Field(default=None, min_length=1, max_length=255)

    @field_validator("mount")
    @classmethod
    def _mount(cls, v: str | None) -> str | None:
        return _check_mount(v)

    @field_validator("members")
    @classmethod
    def _members(cls, v: list[str]) -> list[str]:
        for m in v:
            if not re.fullmatch(r"disks\[[0-9]{1,2}\]\.partitions\[[0-9]{1,2}\]", m):
                raise ValueError(f"{m[:40]!r} is not disks[i].partitions[j]")
        return v


class DiskLayout(BaseModel):
    model_config = ConfigDict(extra="forbid")

    disks: list[DiskSpec] = Field(min_length=1, max_length=MAX_DISKS)
    raid: list[RaidSpec] = Field(default_factory=list, max_length=MAX_RAID)


def _path(prefix: str, loc: tuple[Any, ...]) -> str:
    out = prefix
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def parse_layout(data: Any, field: str = "disk_layout") -> DiskLayout:
    """A layout from JSON data, checked in itself; a 422 names the first field that is wrong, as
    ``disk_layout.disks[0].partitions[2].size``."""
    try:
        layout = DiskLayout.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = _path(field, tuple(err.get("loc", ())))
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        raise InvalidInput(f"{where}: {msg}", field=where) from None
    _check_shape(layout, field)
    return layout


def _check_shape(layout: DiskLayout, field: str) -> None:
    mounts: dict[str, str] = {}
    raid_members: dict[tuple[int, int], str] = {}
    for r, array in enumerate(layout.raid):
        where = f"{field}.raid[{r}]"
        for m, member in enumerate(array.members):
            d, p = (int(x) for x in re.findall(r"[0-9]+", member))
            if d >= len(layout.disks) or p >= len(layout.disks[d].partitions):
                raise InvalidInput(
                    f"{where}.members[{m}]: {member} is not in the layout", field=f"{where}.members[{m}]"
                )
            if layout.disks[d].partitions[p].fs != "raid":
                raise InvalidInput(
                    f"{where}.members[{m}]: {member} must have fs raid", field=f"{where}.members[{m}]"
                )
            if (d, p) in raid_members:
                raise InvalidInput(
                    f"{where}.members[{m}]: {member} is in {raid_members[(d, p)]} already",
                    field=f"{where}.members[{m}]",
                )
            raid_members[(d, p)] = array.name
        if len({d for d, _ in [k for k, v in raid_members.items() if v == array.name]}) < 2:
            raise InvalidInput(
                f"{where}.members: RAID-1 mirrors partitions of two disks or more", field=f"{where}.members"
            )
        if array.mount:
            _add_mount(mounts, array.mount, array.fs, f"{where}.mount")
    if len({a.name for a in layout.raid}) != len(layout.raid):
        raise InvalidInput(f"{field}.raid: two arrays have the same name", field=f"{field}.raid")
    paths = [d.path for d in layout.disks if d.path]
    if len(set(paths)) != len(paths):
        raise InvalidInput(f"{field}.disks: two disks have the same path", field=f"{field}.disks")
    for d, disk in enumerate(layout.disks):
        where = f"{field}.disks[{d}]"
        if not (disk.path or disk.model or disk.min_size):
            raise InvalidInput(f"{where}: choose the disk by path, model or min_size", field=where)
        for p, part in enumerate(disk.partitions):
            pw = f"{where}.partitions[{p}]"
            if part.size == "rest" and p != len(disk.partitions) - 1:
                raise InvalidInput(
                    f"{pw}.size: only the last partition of a disk may be rest", field=f"{pw}.size"
                )
            if part.fs == "raid" and (d, p) not in raid_members:
                raise InvalidInput(
                    f"{pw}.fs: fs raid, but no raid array has it as a member", field=f"{pw}.fs"
                )
            if part.fs in ("raid", "none") and part.mount:
                raise InvalidInput(f"{pw}.mount: fs {part.fs} is not mounted", field=f"{pw}.mount")
            if part.mount:
                _add_mount(mounts, part.mount, part.fs, f"{pw}.mount")
    if "/" not in mounts:
        raise InvalidInput(f"{field}: no partition or array is mounted at /", field=field)


def _add_mount(mounts: dict[str, str], mount: str, fs: str, where: str) -> None:
    if fs == "swap":
        raise InvalidInput(f"{where}: swap has no mount point", field=where)
    if mount in mounts:
        raise InvalidInput(f"{where}: {mount} is mounted by {mounts[mount]} already", field=where)
    mounts[mount] = where.removesuffix(".mount")


# ---- against the node's disks ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ChosenDisk:
    index: int
    device: str  # /dev/vda
    size_bytes: int | None


def choose_disks(
    layout: DiskLayout, disks: list[dict[str, Any]] | None, field: str = "disk_layout"
) -> list[ChosenDisk]:
    """Which of the node's inventoried disks each layout disk is, each checked for room (a 422 naming the
    partition that does not fit). Without inventoried disks only ``path`` choices are possible (and unchecked)."""
    known = [d for d in (disks or []) if isinstance(d, dict) and d.get("name")]
    taken: set[str] = set()
    chosen = []
    for i, spec in enumerate(layout.disks):
        where = f"{field}.disks[{i}]"
        match: dict[str, Any] | None = None
        if spec.path:
            name = spec.path.removeprefix("/dev/")
            match = next((d for d in known if d["name"] == name), None)
            if match is None and known and "/" not in name:
                raise InvalidInput(
                    f"{where}.path: the node has no disk {spec.path} (it has "
                    f"{', '.join(sorted(str(d['name']) for d in known))})",
                    field=f"{where}.path",
                )
        else:
            if not known:
                raise InvalidInput(
                    f"{where}: the node's disks are not inventoried yet; choose this disk by path",
                    field=where,
                )
            candidates = [d for d in known if d["name"] not in taken]
            if spec.model:
                candidates = [
                    d for d in candidates if spec.model.lower() in str(d.get("model") or "").lower()
                ]
            if spec.min_size:
                floor = parse_size(spec.min_size)
                candidates = sorted(
                    (d for d in candidates if int(d.get("size_bytes") or 0) >= floor),
                    key=lambda d: (int(d.get("size_bytes") or 0), str(d["name"])),
                )
            if not candidates:
                what = "model" if spec.model else "min_size"
                raise InvalidInput(f"{where}.{what}: no disk of the node matches", field=f"{where}.{what}")
            match = candidates[0]
        device = spec.path or f"/dev/{match['name']}"  # type: ignore[index]
        if match is not None:
            taken.add(str(match["name"]))
        size = int(match["size_bytes"]) if match is not None and match.get("size_bytes") else None
        if size is not None:
            used = GPT_OVERHEAD
            for p, part in enumerate(spec.partitions):
                need = MIB if part.size == "rest" else parse_size(part.size) + MIB
                used += need
                if used > size:
                    raise InvalidInput(
                        f"{where}.partitions[{p}].size: {part.size} does not fit on {device} "
                        f"({size // MIB} MiB, {max(0, size - used + need) // MIB} MiB left)",
                        field=f"{where}.partitions[{p}].size",
                    )
        chosen.append(ChosenDisk(i, device, size))
    return chosen


def layout_hash(layout: DiskLayout) -> str:
    return hashlib.sha256(json.dumps(layout.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[
        :16
    ]


def partition_device(device: str, number: int) -> str:
    """/dev/vda + 2 → /dev/vda2; /dev/nvme0n1 + 2 → /dev/nvme0n1p2."""
    return f"{device}{'p' if device[-1].isdigit() else ''}{number}"


# ---- the plan the image's init runs ------------------------------------------------------------------------


@dataclass(frozen=True)
class DeltaPlan:
    from_image: str  # "disk:1": what the disk must hold for the delta to apply
    url: str
    initrd_sha256: str  # the new version's initramfs: fetched for /boot/bcm/ only where it differs


def render_plan(
    layout: DiskLayout,
    chosen: list[ChosenDisk],
    *,
    mode: str,
    image: str,
    server_url: str,
    mac: str,
    delta: DeltaPlan | None = None,
) -> str:
    """The install as a POSIX shell script for the image's init (templates/image/init sources it). It uses
    the helpers init defines: ``T`` (run a tool of the fetched image: chroot), ``fail`` and ``report``.

    bcm puts a 1 MiB BIOS boot partition (GRUB's core) first on each disk, so ``partitions[n]`` of a layout
    disk is partition n+2 on it (``/dev/vda2`` for ``partitions[0]``)."""
    q = shlex.quote
    lines = [
        "# rendered by bcm for this boot: the disk layout as commands (see bcm/domain/disk_layout.py)",
        f"BCM_MODE={q(mode)}",
        f"BCM_IMAGE={q(image)}",
        f"BCM_LAYOUT={q(layout_hash(layout))}",
    ]
    if delta is not None:  # an `auto` sync that fetches only what changed since the disk's version
        lines += [
            f"BCM_DELTA_FROM={q(delta.from_image)}",
            f"BCM_DELTA_URL={q(delta.url)}",
            f"BCM_INITRD_SHA256={q(delta.initrd_sha256)}",
        ]
    fstab = ["# rendered by bcm: the disk layout " + layout_hash(layout)]
    mkfs: list[str] = []
    root = ""
    mounts: list[tuple[str, str, str]] = []  # (mount point, device, fs)
    for disk in chosen:
        spec = layout.disks[disk.index]
        script = ["label: gpt", f"start=2048, size=2048, type={BIOS_GRUB}"]
        for p, part in enumerate(spec.partitions, start=FIRST_PARTITION):
            kind = {"swap": LINUX_SWAP, "raid": LINUX_RAID}.get(part.fs, LINUX_FS)
            size = "" if part.size == "rest" else f"size={parse_size(part.size) // 512}, "
            script.append(f"{size}type={kind}")
            dev = partition_device(disk.device, p)
            if part.fs in ("ext4", "xfs", "swap"):
                mkfs.append(_mkfs(part.fs, dev))
                if part.fs == "swap":
                    fstab.append(f"{dev} none swap sw 0 0")
                elif part.mount:
                    mounts.append((part.mount, dev, part.fs))
        lines.append(f"BCM_SFDISK_{disk.index}={q(chr(10).join(script) + chr(10))}")
        lines.append(f"BCM_DISK_{disk.index}={q(disk.device)}")
    arrays = []
    for array in layout.raid:
        members = []
        for m in array.members:
            d, p = (int(x) for x in re.findall(r"[0-9]+", m))
            members.append(
                partition_device(next(c.device for c in chosen if c.index == d), p + FIRST_PARTITION)
            )
        md = f"/dev/{array.name}"
        arrays.append(
            f"T mdadm --create {md} --run --level=1 --metadata=1.0 --raid-devices={len(members)} "
            f'{" ".join(members)} || fail "mdadm {array.name}"'
        )
        mkfs.append(_mkfs(array.fs, md))
        if array.fs == "swap":
            fstab.append(f"{md} none swap sw 0 0")
        elif array.mount:
            mounts.append((array.mount, md, array.fs))
    mounts.sort(key=lambda m: (m[0].count("/") if m[0] != "/" else 0, m[0]))
    for point, dev, fs in mounts:
        if point == "/":
            root = dev
        fstab.append(f"{dev} {point} {fs} defaults 0 0")  # no fsck at boot: the installer made them
    lines.append(f"BCM_DISKS={q(' '.join(str(c.index) for c in chosen))}")
    lines.append(f"BCM_GRUB_DISKS={q(' '.join(c.device for c in chosen))}")
    lines.append(f"BCM_ROOT={q(root)}")
    lines.append(f"BCM_MOUNTS={q(chr(10).join(f'{p} {d}' for p, d, _ in mounts))}")
    lines.append(f"BCM_FSTAB={q(chr(10).join(fstab) + chr(10))}")
    lines.append("bcm_partition() {")
    lines.append("    for i in $BCM_DISKS; do")
    lines.append('        eval "disk=\\$BCM_DISK_$i; script=\\$BCM_SFDISK_$i"')
    lines.append('        T wipefs -a -q "$disk" >/dev/null 2>&1')
    lines.append(
        '        printf "%s" "$script" | T sfdisk -q -w always -W always "$disk" || fail "sfdisk $disk"'
    )
    lines.append('        T blockdev --rereadpt "$disk" >/dev/null 2>&1; T partx -u "$disk" >/dev/null 2>&1')
    lines.append("    done")
    lines.append("    T udevadm settle >/dev/null 2>&1")
    waits = [
        partition_device(c.device, p)
        for c in chosen
        for p in range(FIRST_PARTITION, FIRST_PARTITION + len(layout.disks[c.index].partitions))
    ]
    lines.append(f"    for dev in {' '.join(waits)}; do")
    lines.append('        n=0; while [ ! -b "$dev" ] && [ "$n" -lt 30 ]; do sleep 1; n=$((n + 1)); done')
    lines.append('        [ -b "$dev" ] || fail "no partition $dev after sfdisk"')
    lines.append("    done")
    lines.extend("    " + a for a in arrays)
    lines.extend("    " + m for m in mkfs)
    lines.append("    :")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _mkfs(fs: str, dev: str) -> str:
    if fs == "swap":
        return f'T mkswap -q {dev} >/dev/null || fail "mkswap {dev}"'
    if fs == "xfs":
        return f'T mkfs.xfs -q -f {dev} || fail "mkfs.xfs {dev}"'
    return f'T mkfs.ext4 -q -F {dev} || fail "mkfs.ext4 {dev}"'
