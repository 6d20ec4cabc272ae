"""Kubernetes in bcm without a cluster: settings bounds, GFD labels from the inventory, kubectl-like node
states, and the cordon/taint rules (bcm lifts only its own cordon and taint, an admin's cordon stays).
The node objects are the official client's own models."""

from __future__ import annotations

import pytest
from kubernetes.client import V1Node, V1NodeCondition, V1NodeSpec, V1NodeStatus, V1ObjectMeta, V1Taint
from pydantic import ValidationError

from bcm.domain import kubernetes as k8s
from bcm.drivers.wlm import kubernetes as kdrv
from bcm.errors import InvalidInput


def node(ready: str = "True", unschedulable: bool | None = None, taints=None, notes=None) -> V1Node:
    return V1Node(
        metadata=V1ObjectMeta(name="gpu01", annotations=notes),
        spec=V1NodeSpec(unschedulable=unschedulable, taints=taints),
        status=V1NodeStatus(conditions=[V1NodeCondition(type="Ready", status=ready)]),
    )


def test_gfd_labels_from_inventory() -> None:
    got = k8s.node_gpus([(0, "NVIDIA H100 80GB HBM3", 81559), (1, "NVIDIA H100 80GB HBM3", 81559)])
    assert got.count == 2 and got.product == "NVIDIA-H100-80GB-HBM3"
    assert got.labels == {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.count": "2",
        "nvidia.com/gpu.memory": "81559",
    }
    assert k8s.node_gpus([]).labels == {"nvidia.com/gpu.present": "false"}
    mixed = k8s.node_gpus([(0, "NVIDIA L40S", None), (1, "NVIDIA A100", None), (2, "NVIDIA L40S", None)])
    assert mixed.product == "NVIDIA-L40S" and mixed.count == 3 and "nvidia.com/gpu.memory" not in mixed.labels


def test_label_values_are_bounded_and_legal() -> None:
    value = k8s.product_label("NVIDIA  A100 (80GB) / weird" + "x" * 100)
    assert len(value) <= 63 and all(c.isalnum() or c in "-._" for c in value)
    assert k8s.product_label(None) == "unknown"
    assert k8s.flavor_name("NVIDIA-H100-80GB-HBM3") == "nvidia-h100-80gb-hbm3"


def test_settings_refuse_bad_values() -> None:
    with pytest.raises(ValidationError, match="version"):
        k8s.KubernetesSettings(version="1.36")
    with pytest.raises(ValidationError):
        k8s.KubernetesSettings(pod_subnet="10.0.0.0/30")
    with pytest.raises(ValidationError, match="tools_dir"):
        k8s.KubernetesSettings(tools_dir="/opt/../etc")
    with pytest.raises(ValidationError):
        k8s.KubernetesSettings(mode="kind")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="overlaps"):
        k8s.check_subnets(k8s.KubernetesSettings(pod_subnet="10.96.0.0/16", service_subnet="10.96.0.0/12"))


def test_node_pod_cidr_walks_the_pod_subnet() -> None:
    assert k8s.node_pod_cidr("198.19.64.0/18", 0) == "198.19.64.0/24"
    assert k8s.node_pod_cidr("198.19.64.0/18", 3) == "198.19.67.0/24"
    assert k8s.node_pod_cidr("198.19.64.0/18", 64) == "198.19.64.0/24"  # wraps inside the subnet


def test_node_states_read_like_kubectl() -> None:
    assert kdrv.node_state(node()) == kdrv.WlmNodeState("ready", None)
    assert kdrv.node_state(node("False")).state == "notready"
    assert kdrv.node_state(node("Unknown")).state == "unknown"
    admin = kdrv.node_state(node(unschedulable=True))
    assert admin == kdrv.WlmNodeState("ready,schedulingdisabled", "cordoned")
    m = kdrv.Kubernetes()
    assert m.is_drained(admin) and not m.drained_by_bcm(admin) and m.is_responding(admin)
    assert not m.is_responding(kdrv.node_state(node("False")))


def test_drain_cordons_taints_and_records_the_reason_resume_undoes_only_that() -> None:
    m = kdrv.Kubernetes()
    n = node()
    assert kdrv.apply_drain(n, "bcm: GPU 0 XID 79")
    assert n.spec.unschedulable is True
    assert [(t.key, t.effect) for t in n.spec.taints] == [("bcm.io/gpu-unhealthy", "NoSchedule")]
    state = kdrv.node_state(n)
    assert state == kdrv.WlmNodeState("ready,schedulingdisabled", "bcm: GPU 0 XID 79")
    assert m.drained_by_bcm(state) and m.is_drained(state)
    assert not kdrv.apply_drain(n, "bcm: GPU 0 XID 79")  # nothing to change: no write
    assert kdrv.lift_drain(n)
    assert not n.spec.unschedulable and not n.spec.taints
    assert kdrv.node_state(n) == kdrv.WlmNodeState("ready", None)
    assert not kdrv.lift_drain(n)


def test_an_admins_cordon_and_taints_survive_bcms_drain_and_resume() -> None:
    other = V1Taint(key="maintenance", value="fans", effect="NoSchedule")
    n = node(unschedulable=True, taints=[other])
    kdrv.apply_drain(n, "bcm: GPU 1 XID 48")
    assert len(n.spec.taints) == 2
    kdrv.lift_drain(n)
    assert n.spec.unschedulable is True  # the admin's cordon stays
    assert [t.key for t in n.spec.taints] == ["maintenance"]
    assert kdrv.node_state(n).reason == "cordoned"


def test_clean_reason_is_one_bounded_bcm_line() -> None:
    text = k8s.clean_reason("GPU 0\nXID 79 " + "y" * 500)
    assert text.startswith("bcm: GPU 0 XID 79") and "\n" not in text and len(text) <= 205
    assert k8s.clean_reason("bcm: already") == "bcm: already"


def test_subset_compares_what_bcm_manages_only() -> None:
    want = {"a": 1, "b": [{"c": 2}]}
    assert kdrv.holds(want, {"a": 1, "b": [{"c": 2, "d": 3}], "e": 4})
    assert not kdrv.holds(want, {"a": 1, "b": [{"c": 3}]})
    assert not kdrv.holds(want, {"a": 1, "b": [{"c": 2}, {"c": 2}]})


def test_tenancy_renders_cohorts_queues_namespaces_quotas_and_bindings() -> None:
    from bcm.drivers.wlm import AccountSpec
    from bcm.drivers.wlm import k8s_tenancy as k8t

    accounts = [
        AccountSpec("research", None, 10, None, (), 6),
        AccountSpec("vision", "research", 1, 4, ("alice",), 2),
        AccountSpec("nlp", "research", 3, 4, ("alice", "bob"), 4),
    ]
    objs = {o.key: o for o in k8t.objects(accounts, ["nvidia-h100-80gb-hbm3"])}
    assert list(objs)[0] == "cohort/research"
    cq = objs["clusterqueue/vision"].body["spec"]
    assert cq["cohortName"] == "research" and cq["fairSharing"] == {"weight": "1"}
    res = cq["resourceGroups"][0]["flavors"][0]["resources"][0]
    assert res == {"name": "nvidia.com/gpu", "nominalQuota": "2", "borrowingLimit": "2"}
    assert cq["preemption"]["reclaimWithinCohort"] == "Any"
    assert cq["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "vision"}}
    assert objs["resourcequota/nlp/bcm-gpus"].body["spec"] == {"hard": {"requests.nvidia.com/gpu": "4"}}
    assert objs["localqueue/nlp/nlp"].body["spec"] == {"clusterQueue": "nlp"}
    assert [s["name"] for s in objs["rolebinding/nlp/bcm-members"].body["subjects"]] == ["alice", "bob"]
    assert all(o.body["metadata"]["labels"][k8t.LABEL] == "true" for o in objs.values())
    assert "borrowingLimit 2" in k8t.describe(objs["clusterqueue/vision"])
    # a second flavor gets no nominal quota of its own, only the right to borrow up to the limit
    two = {o.key: o for o in k8t.objects(accounts, ["a100", "h100"])}
    flavors = two["clusterqueue/vision"].body["spec"]["resourceGroups"][0]["flavors"]
    assert [f["resources"][0]["nominalQuota"] for f in flavors] == ["2", "0"]
    assert [f["resources"][0]["borrowingLimit"] for f in flavors] == ["2", "4"]


def test_a_lab_cluster_stays_in_the_lab_address_space() -> None:
    lab = k8s.KubernetesSettings(mode="lab")
    assert (lab.pod_subnet, lab.service_subnet) == (k8s.LAB_POD_SUBNET, k8s.LAB_SERVICE_SUBNET)
    with pytest.raises(ValidationError, match="pod_subnet: a lab cluster's networks"):
        k8s.KubernetesSettings(mode="lab", pod_subnet="10.244.0.0/16")
    assert k8s.KubernetesSettings(mode="lab", pod_subnet="198.18.128.0/18").pod_subnet == "198.18.128.0/18"
    assert k8s.KubernetesSettings().pod_subnet == "10.244.0.0/16"  # real clusters keep kubeadm's default
