"""Workload managers behind one interface (:class:`WorkloadManager`), looked up by a cluster's kind.

Slurm is :mod:`bcm.drivers.wlm.slurm`, Kubernetes :mod:`bcm.drivers.wlm.kubernetes`. Nothing outside this package
imports an implementation: callers ask :func:`get` for the one their cluster's ``kind`` names.
"""

from __future__ import annotations

from functools import cache

from bcm.drivers.wlm.base import (
    AccountSpec,
    AccountUsage,
    AnsibleAccess,
    ClusterSpec,
    Controller,
    DeployPlan,
    NodeUsage,
    Render,
    TenancyChange,
    TenancyPlan,
    VerifyResult,
    WlmHost,
    WlmNodeState,
    WorkloadManager,
    poll_states,
)
from bcm.errors import InvalidInput
from bcm.models.wlm import WlmKind

__all__ = [
    "AccountSpec",
    "AccountUsage",
    "AnsibleAccess",
    "ClusterSpec",
    "Controller",
    "DeployPlan",
    "NodeUsage",
    "Render",
    "TenancyChange",
    "TenancyPlan",
    "VerifyResult",
    "WlmHost",
    "WlmNodeState",
    "WorkloadManager",
    "get",
    "kinds",
    "poll_states",
]


def kinds() -> list[str]:
    """The kinds that have an implementation."""
    return [WlmKind.SLURM.value, WlmKind.KUBERNETES.value]


@cache
def get(kind: str) -> WorkloadManager:
    """The workload manager of ``kind`` (a WlmKind value); 422 for a kind bcm cannot drive yet."""
    if kind == WlmKind.SLURM:
        from bcm.drivers.wlm.slurm import Slurm  # imported here: slurm imports this package's base

        return Slurm()
    if kind == WlmKind.KUBERNETES:
        from bcm.drivers.wlm.kubernetes import Kubernetes

        return Kubernetes()
    raise InvalidInput(
        f"kind: no workload manager {kind!r} in bcm yet (one of {', '.join(kinds())})", field="kind"
    )
