"""Kubernetes as bcm models it: a cluster's stored knobs, and what a node advertises from bcm's inventory.

Pure: no I/O. The driver (bcm.drivers.wlm.kubernetes) renders and applies what this computes.

GPU labels use GPU Feature Discovery's names, so that anything written for the GPU Operator (node
selectors, Kueue ResourceFlavors) works unchanged on a bcm cluster:
``nvidia.com/gpu.present``, ``nvidia.com/gpu.product`` (the NVML name with spaces replaced by ``-``),
``nvidia.com/gpu.count`` and ``nvidia.com/gpu.memory`` (MiB).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bcm.errors import InvalidInput

GPU_RESOURCE = "nvidia.com/gpu"
LABEL_PRESENT = "nvidia.com/gpu.present"
LABEL_PRODUCT = "nvidia.com/gpu.product"
LABEL_COUNT = "nvidia.com/gpu.count"
LABEL_MEMORY = "nvidia.com/gpu.memory"
GFD_LABELS = (LABEL_PRESENT, LABEL_PRODUCT, LABEL_COUNT, LABEL_MEMORY)
BCM_LABEL = "bcm.io/cluster"
TAINT_KEY = "bcm.io/gpu-unhealthy"
REASON_ANNOTATION = "bcm.io/drain-reason"
CORDON_ANNOTATION = "bcm.io/cordoned"  # "true" when the cordon is bcm's (resume lifts only that)
REASON_PREFIX = "bcm: "
SYSTEM_NAMESPACE = "bcm-system"
TOOLS_DEFAULT_DIR = "/var/cache/bcm/k8s/bin-1.36.3"  # scripts/k8s-tools --print
_VERSION = re.compile(r"^1\.[0-9]{2}\.[0-9]{1,3}$")
_LABEL_VALUE = re.compile(r"[^A-Za-z0-9._-]")
_CLUSTER_NAME = re.compile(r"^[a-z][a-z0-9-]{0,39}$")
_SAFE_PATH = re.compile(r"^/[A-Za-z0-9._/-]{1,250}$")
LAB_SPACE = ipaddress.ip_network("198.18.0.0/15")  # the lab's every address stays in here
LAB_POD_SUBNET, LAB_SERVICE_SUBNET = "198.19.64.0/18", "198.19.128.0/17"


class KubernetesSettings(BaseModel):
    """Per-cluster knobs, stored as the cluster's settings JSON; defaults are kubeadm's own."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["kubeadm", "lab"] = "kubeadm"
    """kubeadm: containerd, kubelet and kubeadm on real nodes. lab: the control plane's daemons on the
    control-plane node and a kwok-simulated kubelet on each node (scripts/k8s-tools builds them)."""
    version: str = "1.36.3"
    pod_subnet: str = "10.244.0.0/16"
    service_subnet: str = "10.96.0.0/12"
    dns_domain: str = Field(default="cluster.local", pattern=r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$")
    api_port: int = Field(default=6443, ge=1, le=65535)
    gpu_quota: int | None = Field(default=None, ge=0, le=1_000_000)
    """The GPU quota of bcm's default Kueue ClusterQueue; unset: every GPU the members have."""
    gpu_operator: bool = True
    """Render Helm values for NVIDIA's GPU Operator (driver off: bcm's image carries it); False: the
    device plugin alone."""
    container_toolkit: bool = False
    """The node image carries the NVIDIA container toolkit: containerd gets the nvidia runtime."""
    tools_dir: str = TOOLS_DEFAULT_DIR
    """Head-node directory of what scripts/k8s-tools builds: the lab's every daemon; Kueue in both modes."""
    verify_image: str = Field(
        default="nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04", max_length=200, pattern=r"^[A-Za-z0-9./:@_-]+$"
    )
    """The verification job's image (it runs ``nvidia-smi -L``; the lab's simulated kubelets pull nothing)."""
    node_monitor_grace_s: int = Field(default=20, ge=5, le=600)
    """Lab: how long a silent kubelet stays Ready (the controller manager's grace period)."""

    @field_validator("version")
    @classmethod
    def _version(cls, v: str) -> str:
        if not _VERSION.fullmatch(v):
            raise ValueError("version: a Kubernetes release like 1.36.3")
        return v

    @field_validator("pod_subnet", "service_subnet")
    @classmethod
    def _net(cls, v: str) -> str:
        try:
            net = ipaddress.ip_network(v, strict=True)
        except ValueError as exc:
            raise ValueError(f"a network like 10.96.0.0/12 ({exc})") from None
        if net.version != 4 or net.prefixlen > 24 or net.prefixlen < 8:
            raise ValueError("an IPv4 network between /8 and /24")
        return str(net)

    @model_validator(mode="after")
    def _lab_space(self) -> KubernetesSettings:
        """A lab cluster lives in the lab's address space: unset subnets take the lab's, others must fit."""
        if self.mode != "lab":
            return self
        if "pod_subnet" not in self.model_fields_set:
            self.pod_subnet = LAB_POD_SUBNET
        if "service_subnet" not in self.model_fields_set:
            self.service_subnet = LAB_SERVICE_SUBNET
        for name in ("pod_subnet", "service_subnet"):
            if not ipaddress.ip_network(getattr(self, name)).subnet_of(LAB_SPACE):  # type: ignore[arg-type]
                raise ValueError(f"{name}: a lab cluster's networks must lie inside {LAB_SPACE}")
        return self

    @field_validator("tools_dir")
    @classmethod
    def _dir(cls, v: str) -> str:
        if not _SAFE_PATH.fullmatch(v) or ".." in v.split("/"):
            raise ValueError("tools_dir: an absolute path of letters, digits, '.', '_', '-' and '/'")
        return v.rstrip("/")


def check_cluster_name(name: str) -> str:
    if not _CLUSTER_NAME.fullmatch(name):
        raise InvalidInput(
            f"name: {name!r} is not a valid cluster name (lower-case letter first, then letters, digits"
            " or '-', at most 40)",
            field="name",
        )
    return name


def check_subnets(s: KubernetesSettings) -> None:
    pods, svcs = ipaddress.ip_network(s.pod_subnet), ipaddress.ip_network(s.service_subnet)
    if pods.overlaps(svcs):
        raise InvalidInput(
            f"settings.service_subnet: {svcs} overlaps the pod subnet {pods}", field="settings.service_subnet"
        )


def product_label(name: str | None) -> str:
    """GFD's product label value: the NVML name, spaces as ``-``, bounded to a label value's 63 chars."""
    text = _LABEL_VALUE.sub("-", (name or "unknown").strip().replace(" ", "-")).strip("-._")
    return (text or "unknown")[:63].rstrip("-._")


@dataclass(frozen=True)
class NodeGpus:
    """What a node advertises: GPU count, GFD labels, and the product its ResourceFlavor keys on."""

    count: int
    labels: dict[str, str]
    product: str | None


def node_gpus(gpus: Sequence[tuple[int, str | None, int | None]]) -> NodeGpus:
    """From the inventoried GPUs ``(index, name, memory MiB)``: a node's capacity and GFD labels.

    A node with mixed products advertises the most common one (GFD does the same with its default
    single strategy); no GPUs → ``nvidia.com/gpu.present=false`` and no product.
    """
    if not gpus:
        return NodeGpus(0, {LABEL_PRESENT: "false"}, None)
    names = [product_label(n) for _, n, _ in gpus]
    product = max(sorted(set(names)), key=names.count)
    mems = [m for _, n, m in gpus if m and product_label(n) == product]
    labels = {LABEL_PRESENT: "true", LABEL_PRODUCT: product, LABEL_COUNT: str(len(gpus))}
    if mems:
        labels[LABEL_MEMORY] = str(min(mems))
    return NodeGpus(len(gpus), labels, product)


def flavor_name(product: str) -> str:
    """A Kueue ResourceFlavor name (a DNS-1123 label) for a GPU product."""
    text = re.sub(r"[^a-z0-9-]", "-", product.lower()).strip("-")
    return (re.sub(r"-{2,}", "-", text) or "gpu")[:63].rstrip("-")


def clean_reason(reason: str | None) -> str:
    """``bcm: <reason>`` on one line, bounded to what an annotation should carry."""
    text = " ".join((reason or "drained by bcm").split())[:200]
    return text if text.startswith(REASON_PREFIX) else REASON_PREFIX + text


def node_pod_cidr(pod_subnet: str, index: int) -> str:
    """The ``index``-th /24 of the pod subnet (the lab's simulated kubelets hand pod IPs from it)."""
    net = ipaddress.ip_network(pod_subnet)
    count = 2 ** (24 - net.prefixlen) if net.prefixlen <= 24 else 1
    base = int(net.network_address) + (index % count) * 256
    return str(ipaddress.ip_network((base, 24)))
