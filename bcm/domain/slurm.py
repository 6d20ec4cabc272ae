"""The Slurm configuration model: what slurm.conf, gres.conf, cgroup.conf and slurmdbd.conf say, built
from inventoried nodes, their GPUs and categories. Pure code: the templates only print this model.

Lab and production differ only in ``SlurmSettings`` (cgroup-based process tracking by default; the
lab turns on ``proctrack/linuxproc``, ``task/none`` and ``config_overrides``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from bcm.domain.naming import check_name, fold_hostlist
from bcm.errors import InvalidInput

# Marketing words in front of the model; "NVIDIA H100 80GB HBM3" -> "h100".
_VENDOR_WORDS = {"nvidia", "tesla", "geforce", "quadro", "grid"}
_SAFE_PATH = re.compile(r"^/[A-Za-z0-9._/-]*$")
_CLUSTER_NAME = re.compile(r"^[a-z][a-z0-9_]{0,39}$")  # slurmdbd stores it in table names


class SlurmSettings(BaseModel):
    """Per-cluster knobs, stored as the cluster's settings JSON; defaults are the production ones."""

    model_config = ConfigDict(extra="forbid")

    slurm_user: str = Field(default="slurm", pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    proctrack_type: Literal["proctrack/cgroup", "proctrack/linuxproc", "proctrack/pgid"] = "proctrack/cgroup"
    task_plugin: str = Field(default="task/cgroup,task/affinity", pattern=r"^task/[a-z]+(,task/[a-z]+)*$")
    jobacct_gather_type: Literal["jobacct_gather/cgroup", "jobacct_gather/linux", "jobacct_gather/none"] = (
        "jobacct_gather/cgroup"
    )
    slurmd_parameters: str | None = Field(default=None, pattern=r"^[a-z_=,0-9]+$")
    return_to_service: int = Field(default=2, ge=0, le=2)
    gres_autodetect: Literal["off", "nvml"] = "off"
    gpu_device_dir: str = "/dev"
    constrain_devices: bool = True
    accounting_enforce: str = Field(default="", pattern=r"^[a-z,]*$")
    storage_host: str = Field(default="localhost", pattern=r"^[A-Za-z0-9.:-]+$")
    storage_port: int = Field(default=3306, ge=1, le=65535)
    storage_user: str = Field(default="slurm", pattern=r"^[A-Za-z0-9_.-]{1,80}$")
    storage_loc: str = Field(default="slurm_acct_db", pattern=r"^[A-Za-z0-9_]{1,64}$")
    default_partition: str = Field(default="all", pattern=r"^[a-z][a-z0-9_-]{0,62}$")
    max_time: str = Field(default="INFINITE", pattern=r"^(INFINITE|[0-9:-]+)$")
    priority_calc_period: int = Field(default=5, ge=1, le=1440)  # minutes between fair-share recalculations

    @field_validator("gpu_device_dir")
    @classmethod
    def _dir(cls, v: str) -> str:
        if not _SAFE_PATH.fullmatch(v) or ".." in v.split("/"):
            raise ValueError("gpu_device_dir: an absolute path of letters, digits, '.', '_', '-' and '/'")
        return v.rstrip("/") or "/"


@dataclass(frozen=True)
class GpuSet:
    """GPUs of one type on one node, by device index."""

    type: str
    indices: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.indices)

    def files(self, device_dir: str) -> str:
        """``/dev/nvidia[0-7]`` (a Slurm range expression over the device indices)."""
        base = device_dir.rstrip("/") + "/nvidia"
        if len(self.indices) == 1:
            return f"{base}{self.indices[0]}"
        return f"{base}[{_ranges(self.indices)}]"


@dataclass(frozen=True)
class SlurmNode:
    name: str
    addr: str | None
    cpus: int
    sockets: int | None
    cores_per_socket: int | None
    threads_per_core: int | None
    real_memory_mib: int
    gpus: tuple[GpuSet, ...] = ()
    partitions: tuple[str, ...] = ()

    @property
    def gres(self) -> str:
        return ",".join(f"gpu:{g.type}:{g.count}" for g in self.gpus)

    @property
    def gpu_count(self) -> int:
        return sum(g.count for g in self.gpus)

    def line(self) -> str:
        """The node's slurm.conf line."""
        parts = [f"NodeName={self.name}"]
        if self.addr:
            parts.append(f"NodeAddr={self.addr}")
        parts.append(f"CPUs={self.cpus}")
        if self.sockets and self.cores_per_socket and self.threads_per_core:
            parts += [
                f"Sockets={self.sockets}",
                f"CoresPerSocket={self.cores_per_socket}",
                f"ThreadsPerCore={self.threads_per_core}",
            ]
        parts.append(f"RealMemory={self.real_memory_mib}")
        if self.gpus:
            parts.append(f"Gres={self.gres}")
        parts.append("State=UNKNOWN")
        return " ".join(parts)


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: str  # folded hostlist, or ALL
    default: bool
    max_time: str

    def line(self) -> str:
        return (
            f"PartitionName={self.name} Nodes={self.nodes} Default={'YES' if self.default else 'NO'}"
            f" MaxTime={self.max_time} State=UP"
        )


@dataclass(frozen=True)
class SlurmCluster:
    """Everything the Slurm templates print."""

    name: str
    controller: str
    controller_addr: str | None
    nodes: tuple[SlurmNode, ...]
    partitions: tuple[Partition, ...]
    settings: SlurmSettings
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hostlist(self) -> str:
        return fold_hostlist([n.name for n in self.nodes])

    @property
    def total_gpus(self) -> int:
        return sum(n.gpu_count for n in self.nodes)


@dataclass(frozen=True)
class NodeInput:
    """What the model needs about one member node (from the Node row, its interfaces and GPU rows)."""

    name: str
    addr: str | None
    facts: dict[str, Any]
    gpus: Sequence[tuple[int, str | None]]  # (index, product name)
    category: str | None = None


def gres_type(gpu_name: str | None) -> str:
    """The GRES type Slurm users ask for: ``NVIDIA H100 80GB HBM3`` -> ``h100``, ``NVIDIA RTX A6000`` -> ``rtxa6000``."""
    words = [w for w in re.split(r"[\s_]+", (gpu_name or "").strip()) if w]
    words = [w for w in words if w.lower() not in _VENDOR_WORDS]
    if not words:
        return "gpu"
    first = words[0].split("-")[0].lower()
    if first in ("rtx", "gtx", "titan") and len(words) > 1:
        first += words[1].split("-")[0].lower()
    cleaned = re.sub(r"[^a-z0-9]", "", first)
    return cleaned or "gpu"


def slurm_node(spec: NodeInput) -> SlurmNode:
    """One node's hardware as Slurm counts it; InvalidInput when the facts lack CPUs or memory."""
    cpu = spec.facts.get("cpu") or {}
    threads = _int(cpu.get("threads"))
    cores = _int(cpu.get("cores"))
    sockets = _int(cpu.get("sockets"))
    memory = _int(spec.facts.get("memory_bytes"))
    if not threads or not memory:
        raise InvalidInput(
            f"node {spec.name}: inventory facts lack CPU count or memory; run `bcm node inventory {spec.name}`",
            field="nodes",
        )
    cores_per_socket = threads_per_core = None
    if sockets and cores and cores % sockets == 0 and threads % cores == 0:
        cores_per_socket, threads_per_core = cores // sockets, threads // cores
    else:
        sockets = None
    by_type: dict[str, list[int]] = {}
    for index, name in sorted(spec.gpus):
        by_type.setdefault(gres_type(name), []).append(index)
    return SlurmNode(
        name=spec.name,
        addr=spec.addr,
        cpus=threads,
        sockets=sockets,
        cores_per_socket=cores_per_socket,
        threads_per_core=threads_per_core,
        real_memory_mib=memory // (1024 * 1024),
        gpus=tuple(GpuSet(t, tuple(ix)) for t, ix in sorted(by_type.items())),
        partitions=(spec.category,) if spec.category else (),
    )


def partitions(nodes: Iterable[SlurmNode], settings: SlurmSettings) -> tuple[Partition, ...]:
    """The default partition over all nodes, then one partition per category (sorted by name)."""
    members: dict[str, list[str]] = {}
    for node in nodes:
        for part in node.partitions:
            members.setdefault(part, []).append(node.name)
    out = [Partition(settings.default_partition, "ALL", True, settings.max_time)]
    for name in sorted(members):
        if name != settings.default_partition:
            out.append(Partition(name, fold_hostlist(members[name]), False, settings.max_time))
    return tuple(out)


def build_cluster(
    name: str,
    controller: str,
    controller_addr: str | None,
    nodes: Sequence[NodeInput],
    settings: SlurmSettings,
) -> SlurmCluster:
    """The whole configuration model; InvalidInput naming every node whose facts are unusable."""
    check_cluster_name(name)
    check_name(controller, "controller")
    built, problems = [], []
    for spec in sorted(nodes, key=lambda n: n.name):
        try:
            built.append(slurm_node(spec))
        except InvalidInput as exc:
            problems.append(exc.message)
    if problems:
        raise InvalidInput("; ".join(problems[:10]), field="nodes")
    if not built:
        raise InvalidInput("nodes: a Slurm cluster needs at least one node", field="nodes")
    return SlurmCluster(
        name=name,
        controller=controller,
        controller_addr=controller_addr,
        nodes=tuple(built),
        partitions=partitions(built, settings),
        settings=settings,
    )


def check_cluster_name(name: str) -> str:
    if not _CLUSTER_NAME.fullmatch(name):
        raise InvalidInput(
            f"name: {name!r} is not a valid Slurm cluster name (lower-case letter first, then letters,"
            " digits or '_', at most 40)",
            field="name",
        )
    return name


def _ranges(indices: Sequence[int]) -> str:
    """``0,1,2,5`` -> ``0-2,5``."""
    out: list[str] = []
    start = prev = indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(out)


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None
