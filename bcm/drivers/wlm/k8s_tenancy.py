"""Tenancy rendered into Kubernetes and Kueue (pure: objects in, objects out; the driver reads and writes).

- department → Kueue ``Cohort`` (fair-sharing weight = its fair share)
- project → ``Namespace`` + ``ResourceQuota`` (``requests.nvidia.com/gpu`` = its limit) + Kueue
  ``ClusterQueue`` in the department's cohort (``nominalQuota`` = deserved, ``borrowingLimit`` = limit −
  deserved, fair-sharing weight, reclaim within the cohort) + ``LocalQueue`` + a ``RoleBinding`` of its
  members to the ``edit`` role in its namespace.

Every object carries ``bcm.io/tenancy=true``, so bcm finds (and only ever removes) its own.

Use is read back the same way round: a running pod's namespace is its project (:func:`pod_usage`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from bcm.domain import kubernetes as k8s
from bcm.drivers.wlm.base import AccountSpec, NodeUsage

LABEL = "bcm.io/tenancy"
LABELS = {LABEL: "true", "app.kubernetes.io/managed-by": "bcm"}
KUEUE = "kueue.x-k8s.io/v1beta2"
QUOTA = "bcm-gpus"
BINDING = "bcm-members"
MEMBER_ROLE = "edit"


@dataclass(frozen=True)
class Obj:
    """One object bcm wants: kind, namespace (None: cluster-scoped), name, and its managed content."""

    kind: str
    namespace: str | None
    name: str
    body: dict[str, Any]

    @property
    def key(self) -> str:
        return f"{self.kind.lower()}/{self.namespace + '/' if self.namespace else ''}{self.name}"

    @property
    def content(self) -> dict[str, Any]:
        """What bcm compares with the live object (the rest is the server's)."""
        return {k: v for k, v in self.body.items() if k not in ("apiVersion", "kind", "metadata")}


def _meta(name: str, namespace: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": dict(LABELS)}
    if namespace:
        meta["namespace"] = namespace
    return meta


def objects(accounts: Sequence[AccountSpec], flavors: Sequence[str]) -> list[Obj]:
    """Everything the model wants, in the order it is created (cohorts and namespaces first)."""
    out: list[Obj] = []
    for a in accounts:
        if a.parent is None:
            out.append(
                Obj(
                    "Cohort",
                    None,
                    a.name,
                    {
                        "apiVersion": KUEUE,
                        "kind": "Cohort",
                        "metadata": _meta(a.name),
                        "spec": {"fairSharing": {"weight": str(a.fairshare)}},
                    },
                )
            )
    for a in accounts:
        if a.parent is None:
            continue
        deserved = a.gpu_deserved or 0
        limit = a.gpu_limit if a.gpu_limit is not None else deserved
        groups = []
        for i, flavor in enumerate(flavors):
            nominal = deserved if i == 0 else 0
            groups.append(
                {
                    "name": flavor,
                    "resources": [
                        {
                            "name": k8s.GPU_RESOURCE,
                            "nominalQuota": str(nominal),
                            "borrowingLimit": str(max(0, limit - nominal)),
                        }
                    ],
                }
            )
        ns = a.name
        out.append(
            Obj("Namespace", None, ns, {"apiVersion": "v1", "kind": "Namespace", "metadata": _meta(ns)})
        )
        out.append(
            Obj(
                "ResourceQuota",
                ns,
                QUOTA,
                {
                    "apiVersion": "v1",
                    "kind": "ResourceQuota",
                    "metadata": _meta(QUOTA, ns),
                    "spec": {"hard": {f"requests.{k8s.GPU_RESOURCE}": str(limit)}},
                },
            )
        )
        out.append(
            Obj(
                "ClusterQueue",
                None,
                a.name,
                {
                    "apiVersion": KUEUE,
                    "kind": "ClusterQueue",
                    "metadata": _meta(a.name),
                    "spec": {
                        "cohortName": a.parent,
                        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                        "queueingStrategy": "BestEffortFIFO",
                        "resourceGroups": [{"coveredResources": [k8s.GPU_RESOURCE], "flavors": groups}]
                        if groups
                        else [],
                        "preemption": {"reclaimWithinCohort": "Any", "withinClusterQueue": "LowerPriority"},
                        "fairSharing": {"weight": str(a.fairshare)},
                    },
                },
            )
        )
        out.append(
            Obj(
                "LocalQueue",
                ns,
                a.name,
                {
                    "apiVersion": KUEUE,
                    "kind": "LocalQueue",
                    "metadata": _meta(a.name, ns),
                    "spec": {"clusterQueue": a.name},
                },
            )
        )
        out.append(
            Obj(
                "RoleBinding",
                ns,
                BINDING,
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "RoleBinding",
                    "metadata": _meta(BINDING, ns),
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "ClusterRole",
                        "name": MEMBER_ROLE,
                    },
                    "subjects": [
                        {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": u} for u in a.users
                    ],
                },
            )
        )
    return out


def describe(obj: Obj) -> str:
    """One line saying what the object holds (a plan's detail)."""
    spec = obj.body.get("spec") or {}
    if obj.kind == "ClusterQueue":
        res = [r for g in spec.get("resourceGroups", []) for f in g["flavors"] for r in f["resources"]]
        nominal = sum(int(r["nominalQuota"]) for r in res)
        borrow = max((int(r["borrowingLimit"]) for r in res), default=0)
        return (
            f"cohort {spec.get('cohortName')}, nominalQuota {nominal}, borrowingLimit {borrow},"
            f" weight {spec['fairSharing']['weight']}"
        )
    if obj.kind == "ResourceQuota":
        return ", ".join(f"{k}={v}" for k, v in spec["hard"].items())
    if obj.kind == "RoleBinding":
        return "members: " + (", ".join(s["name"] for s in obj.body["subjects"]) or "none")
    if obj.kind == "Cohort":
        return f"weight {spec['fairSharing']['weight']}"
    if obj.kind == "LocalQueue":
        return f"clusterQueue {spec['clusterQueue']}"
    return obj.name


QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def _quantity(value: Any) -> int:
    """A GPU count from a resource quantity (``"2"``; anything else counts as none)."""
    text = str(value).strip()
    return int(text) if text.isdigit() else 0


def pod_gpus(pod: dict[str, Any]) -> int:
    """GPUs a pod's containers hold (limits, or requests where no limit is set: extended resources
    need both equal)."""
    total = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        limits, requests = res.get("limits") or {}, res.get("requests") or {}
        total += _quantity(limits.get(k8s.GPU_RESOURCE, requests.get(k8s.GPU_RESOURCE, 0)))
    return total


def pod_usage(pods: Iterable[dict[str, Any]]) -> list[NodeUsage]:
    """Per (node, namespace): the running pods that hold GPUs or were admitted through a Kueue queue, and
    their GPUs (pods as the API serializes them). The system's own pods on every node are no tenant."""
    held: dict[tuple[str, str], list[int]] = {}
    for pod in pods:
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        node, namespace = spec.get("nodeName"), meta.get("namespace")
        if (pod.get("status") or {}).get("phase") != "Running" or not node or not namespace:
            continue
        gpus = pod_gpus(pod)
        if gpus == 0 and QUEUE_LABEL not in (meta.get("labels") or {}):
            continue
        slot = held.setdefault((str(node), str(namespace)), [0, 0])
        slot[0] += gpus
        slot[1] += 1
    return [NodeUsage(node, ns, gpus, pods) for (node, ns), (gpus, pods) in sorted(held.items())]
