"""Zero-touch into Kubernetes (#29): the Slurm flow of tests/lab/test_zero_touch.py, for a category whose
`wlm_cluster` names a Kubernetes cluster, with one VM. Through documented commands only: `bcm serve` with a
real dnsmasq, the lab (a control-plane namespace node, one GPU node, one qemu VM with an unknown MAC behind an
IPMI BMC emulator), `bcm pxe enable`, the README's Kubernetes deploy (a real kube-apiserver, etcd, controller
manager and scheduler on node01, kwok for each node's kubelet, Kueue), then a category with a discovery rule,
`--auto-provision` and `--wlm-cluster`. After `bcm lab vm-power on --pxe` no bcm command runs: the VM is
discovered, registered, provisioned through the BMC it reported, booted, inventoried, joined to Kubernetes by
a `bcm:zero-touch` deploy (Ansible copies kwok to it; its Node object is made from bcm's inventory) and
verified by its own one-node Kueue job → `ready`, Ready in the API server. Then `bcm node retire` makes it
leave the cluster: its Node object is gone and the GPU node stays.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from bcm.domain.naming import expand_hostlist
from bcm.lab.lab import Lab
from tests.lab.test_health_e2e import until
from tests.lab.test_readme import README, sh_lines
from tests.lab.test_zero_touch import COMMAND_TIMEOUT_S, Flow, flow  # noqa: F401 (the fixture: its server and teardown)

pytestmark = pytest.mark.lab

KUBECTL = ["/usr/local/lib/bcm-k8s/bin/kubectl", "--kubeconfig", "/etc/bcm-k8s/admin.kubeconfig"]
BCM = ".venv/bin/bcm"
SETUP = [
    f"echo lab-bmc-pw | {BCM} lab up --nodes 2 --gpus 1 --vms 1 --discover-vms --vm-bmc-password-stdin",
    f"{BCM} pxe enable --interface bcmlab-prov --address 198.18.0.1 --range 198.18.0.100-198.18.0.150",
    f"{BCM} node inventory 'node[01-02]'",
    f"{BCM} wlm deploy kubernetes --name ztk --control-plane node01 --nodes node02",  # the cluster it joins
    f"{BCM} category add ztk --image lab --discover-mac-prefix 52:54:00:1a --discover-names 'zk[01-16]'"
    " --auto-provision --wlm-cluster ztk",
    f"echo lab-bmc-pw | {BCM} power set-category ztk --user admin --protocol ipmi --password-stdin"
    " --discover-range 198.18.0.192/26",
]
POWER_ON = f"{BCM} lab vm-power on --pxe"  # the power button; nothing more to type
WAIT = f"{BCM} node wait zk01 --state ready --timeout 2400"


def k8s_nodes(lab: Lab) -> dict[str, Any]:
    done = lab.run("node01", [*KUBECTL, "get", "nodes", "-o", "json"], timeout=60)
    assert done.returncode == 0, f"kubectl: {done.stdout}{done.stderr}"
    return {n["metadata"]["name"]: n for n in json.loads(done.stdout)["items"]}


def ready(node: Any) -> str:
    return next((c["status"] for c in node["status"].get("conditions", []) if c["type"] == "Ready"), "?")


@pytest.mark.timeout(3 * COMMAND_TIMEOUT_S)
def test_power_on_to_ready_in_kubernetes_with_no_command(flow: Flow) -> None:  # noqa: F811
    flow.sh(next(ln for ln in sh_lines(README.read_text()) if "bcm image build lab" in ln))
    for line in [*SETUP, POWER_ON, WAIT]:
        flow.sh(line)
    lab = Lab(flow.server.state_dir / "lab" / "bcmlab", "bcmlab")

    node = flow.json("node", "show", "zk01")
    assert node["provision_state"] == "ready" and node["category"] == "ztk" and node["last_error"] is None, (
        node
    )
    assert node["bmc_address"] and node["inventoried_at"], node

    # the API server's truth: the VM's Node object, Ready (its kwok kubelet runs on the VM), bcm's label
    seen = k8s_nodes(lab)
    assert set(seen) == {"node02", "zk01"}, sorted(seen)
    assert ready(seen["zk01"]) == "True", seen["zk01"]["status"]
    assert seen["zk01"]["metadata"]["labels"]["bcm.io/cluster"] == "ztk"
    assert seen["zk01"]["status"]["addresses"][0]["address"] == node["interfaces"][0]["ip"], seen["zk01"][
        "status"
    ]
    cluster = flow.json("wlm", "status", "ztk", "--sync")
    states = {m["name"]: m["wlm_state"] for m in cluster["members"]}
    assert states.get("zk01") == "ready" and states.get("node02") == "ready", cluster

    # nobody typed a command for the VM: its join was bcm's, verified by its own one-node job
    ops = flow.json("op", "list", "--limit", "200")
    ops = ops["items"] if isinstance(ops, dict) else ops
    touching = [o for o in ops if o["targets"] and "zk01" in expand_hostlist(o["targets"])]
    assert touching and all((o["created_by"] or "").startswith("bcm:") for o in touching), [
        (o["kind"], o["targets"], o["created_by"]) for o in touching
    ]
    joins = [o for o in ops if o["kind"] == "wlm.deploy" and o["created_by"] == "bcm:zero-touch"]
    assert len(joins) == 1 and joins[0]["state"] == "succeeded", joins
    log = flow.json("op", "show", str(joins[0]["id"]))["log"]
    assert "verify zk01: passed" in log, log[-3000:]

    # retired, it leaves the cluster: bcm's next join round deploys the cluster without it
    flow.sh(f"{BCM} node retire zk01")
    until("zk01's Node object to be deleted", lambda: "zk01" not in k8s_nodes(lab), 600, 5)
    assert ready(k8s_nodes(lab)["node02"]) == "True"
    left = flow.json("wlm", "status", "ztk")
    assert {m["name"] for m in left["members"]} == {"node02"}, left
