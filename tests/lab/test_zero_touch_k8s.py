"""Zero-touch into Kubernetes (#29): the Slurm flow of tests/lab/test_zero_touch.py (the README's), for a
category whose `wlm_cluster` names a Kubernetes cluster. Through documented commands only: `bcm serve` with a
real dnsmasq, the lab (a control-plane namespace node, one GPU node, four qemu VMs with unknown MACs behind
IPMI BMC emulators), `bcm pxe enable`, the README's Kubernetes deploy (a real kube-apiserver, etcd, controller
manager and scheduler on node01, kwok for each node's kubelet, Kueue), then a category with a discovery rule,
`--auto-provision` and `--wlm-cluster`, and a second one whose image is broken for the fourth VM. After
`bcm lab vm-power on --pxe` no bcm command runs: three VMs are discovered, registered, provisioned through the
BMCs they reported, booted, inventoried, joined to Kubernetes by `bcm:zero-touch` deploys (Ansible copies
kwok to them; their Node objects are made from bcm's inventory) and verified by their own one-node Kueue jobs
→ `ready`, Ready in the API server; the fourth ends `failed` with its initramfs's reason and never becomes a
Node. Then `bcm node retire` makes one leave the cluster: its Node object is gone and the others stay.
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
    f"echo lab-bmc-pw | {BCM} lab up --nodes 2 --gpus 1 --vms 4 --discover-vms --vm-bmc-password-stdin",
    f"{BCM} pxe enable --interface bcmlab-prov --address 198.18.0.1 --range 198.18.0.100-198.18.0.150",
    f"{BCM} node inventory 'node[01-02]'",
    f"{BCM} wlm deploy kubernetes --name ztk --control-plane node01 --nodes node02",  # the cluster it joins
    f"{BCM} category add ztk --image lab --discover-mac-prefix 52:54:00:1a --discover-names 'zk[01-16]'"
    " --auto-provision --wlm-cluster ztk",
    f"echo lab-bmc-pw | {BCM} power set-category ztk --user admin --protocol ipmi --password-stdin"
    " --discover-range 198.18.0.192/26",
    # vm04's category has a broken image (the lab image without /sbin/init), as in the README's Slurm flow
    f"{BCM} image build lab-broken",
    f"{BCM} category add kbad --image lab-broken --discover-mac-prefix 52:54:00:1a:00:04 --discover-names kbad01"
    " --auto-provision --wlm-cluster ztk",
    f"echo lab-bmc-pw | {BCM} power set-category kbad --user admin --protocol ipmi --password-stdin"
    " --discover-range 198.18.0.192/26",
]
POWER_ON = f"{BCM} lab vm-power on --pxe"  # the power buttons; nothing more to type
GOOD = ["zk01", "zk02", "zk03"]
WAIT = [
    f"{BCM} node wait 'zk[01-03]' --state ready --timeout 2400",
    f"{BCM} node wait kbad01 --state failed --timeout 600",
]


def k8s_nodes(lab: Lab) -> dict[str, Any]:
    done = lab.run("node01", [*KUBECTL, "get", "nodes", "-o", "json"], timeout=60)
    assert done.returncode == 0, f"kubectl: {done.stdout}{done.stderr}"
    return {n["metadata"]["name"]: n for n in json.loads(done.stdout)["items"]}


def ready(node: Any) -> str:
    return next((c["status"] for c in node["status"].get("conditions", []) if c["type"] == "Ready"), "?")


@pytest.mark.timeout(3 * COMMAND_TIMEOUT_S)
def test_power_on_to_ready_in_kubernetes_with_no_command(flow: Flow) -> None:  # noqa: F811
    flow.sh(next(ln for ln in sh_lines(README.read_text()) if "bcm image build lab" in ln))
    for line in [*SETUP, POWER_ON, *WAIT]:
        flow.sh(line)
    lab = Lab(flow.server.state_dir / "lab" / "bcmlab", "bcmlab")

    nodes = {n: flow.json("node", "show", n) for n in [*GOOD, "kbad01"]}
    for name in GOOD:
        n = nodes[name]
        assert n["provision_state"] == "ready" and n["category"] == "ztk" and n["last_error"] is None, n
        assert n["bmc_address"] and n["inventoried_at"], n
    bad = nodes["kbad01"]
    assert bad["provision_state"] == "failed" and bad["category"] == "kbad", bad
    assert "bcm-init: the root image has no /sbin/init" in bad["last_error"], bad["last_error"]

    # the API server's truth: the VMs' Node objects, Ready (their kwok kubelets run on the VMs), bcm's label;
    # the failed machine never became a Node
    seen = k8s_nodes(lab)
    assert set(seen) == {"node02", *GOOD}, sorted(seen)
    for name in GOOD:
        assert ready(seen[name]) == "True", seen[name]["status"]
        assert seen[name]["metadata"]["labels"]["bcm.io/cluster"] == "ztk"
        assert seen[name]["status"]["addresses"][0]["address"] == nodes[name]["interfaces"][0]["ip"], seen[
            name
        ]
    cluster = flow.json("wlm", "status", "ztk", "--sync")
    states = {m["name"]: m["wlm_state"] for m in cluster["members"]}
    assert {n: states.get(n) for n in ["node02", *GOOD]} == dict.fromkeys(["node02", *GOOD], "ready"), cluster
    assert "kbad01" not in states

    # nobody typed a command for the VMs: their joins were bcm's, each node verified by its own one-node job
    ops = flow.json("op", "list", "--limit", "200")
    ops = ops["items"] if isinstance(ops, dict) else ops
    touching = [o for o in ops if o["targets"] and set(expand_hostlist(o["targets"])) & {*GOOD, "kbad01"}]
    assert touching and all((o["created_by"] or "").startswith("bcm:") for o in touching), [
        (o["kind"], o["targets"], o["created_by"]) for o in touching
    ]
    joins = [o for o in ops if o["kind"] == "wlm.deploy" and o["created_by"] == "bcm:zero-touch"]
    assert joins and all(o["state"] == "succeeded" for o in joins), joins
    assert len(joins) <= 2, joins  # the rack joined in one deploy (two at most when one VM lagged by minutes)
    logs = "".join(flow.json("op", "show", str(o["id"]))["log"] for o in joins)
    for name in GOOD:
        assert f"verify {name}: passed" in logs, logs[-3000:]

    # retired, it leaves the cluster: bcm's next join round deploys the cluster without it
    flow.sh(f"{BCM} node retire zk01")
    until("zk01's Node object to be deleted", lambda: "zk01" not in k8s_nodes(lab), 600, 5)
    after = k8s_nodes(lab)
    assert all(ready(after[n]) == "True" for n in ("node02", "zk02", "zk03")), after
    left = flow.json("wlm", "status", "ztk")
    assert {m["name"] for m in left["members"]} == {"node02", "zk02", "zk03"}, left
