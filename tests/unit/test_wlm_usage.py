"""Who runs where: squeue's running jobs (a recorded sample), running pods, and the bounds kept on a sample."""

from __future__ import annotations

import shlex
from pathlib import Path

from bcm.drivers.wlm import k8s_tenancy as k8t
from bcm.drivers.wlm import slurm_usage
from bcm.drivers.wlm.base import NodeUsage
from bcm.models.wlm import ACCOUNT_MAX, TENANTS_PER_NODE
from bcm.services.wlm_usage import bounded

DATA = Path(__file__).resolve().parents[1] / "data" / "squeue"


def test_the_command_is_the_one_the_sample_was_recorded_with() -> None:
    recorded = (
        "squeue -h -r -t R -O 'JobID:0|,Account:0|,NodeList:0|,tres-alloc:0|,tres-per-node:0|,tres-per-job:0'"
    )
    assert shlex.join(slurm_usage.SQUEUE_ARGV) == recorded
    assert recorded in (DATA / "README.md").read_text()


def test_recorded_squeue_of_slurm_22_05_gives_gpus_per_node_and_account() -> None:
    got = slurm_usage.parse_running((DATA / "running-22.05.txt").read_text())
    # nlp: --gres=gpu:h100:2 (tres-per-node); vision: --gpus=1 (tres-per-job) and an array task with
    # --gpus-per-node=1 (tres-per-node)
    assert got == [NodeUsage("gpu01", "nlp", 2, 1), NodeUsage("gpu01", "vision", 2, 2)]


def test_accounted_gpus_are_split_across_the_jobs_nodes() -> None:
    out = (
        "17|nlp|gpu[01-03]|cpu=24,mem=96G,node=3,billing=24,gres/gpu=7|N/A|gres:gpu:7\n"  # --gpus=7: 3+2+2
        "18|vision|gpu03|cpu=2,mem=8G,node=1,billing=2,gres/gpu:h100=1|gres/gpu:h100:1|N/A\n"  # typed only
        "19|infra|gpu[02,04]|cpu=2,mem=1G,node=2,billing=2|N/A|N/A\n"  # no GPUs: a tenant all the same
        "20|nlp|gpu[03-04]|cpu=4,node=2,billing=4|gres:gpu:2|N/A\n"  # not accounted: 2 on each node
    )
    got = {(u.node, u.account): (u.gpus, u.jobs) for u in slurm_usage.parse_running(out)}
    assert got == {
        ("gpu01", "nlp"): (3, 1),
        ("gpu02", "nlp"): (2, 1),
        ("gpu03", "nlp"): (4, 2),
        ("gpu04", "nlp"): (2, 1),
        ("gpu03", "vision"): (1, 1),
        ("gpu02", "infra"): (0, 1),
        ("gpu04", "infra"): (0, 1),
    }


def test_lines_without_an_account_or_nodes_and_foreign_names_are_left_out() -> None:
    out = (
        "\n"
        "21|(null)|gpu01|cpu=1,node=1,billing=1,gres/gpu=1|N/A|N/A\n"  # no accounting: no tenant
        "22|nlp||cpu=1|N/A|N/A\n"
        "23|nlp|GPU_01|cpu=1,gres/gpu=1|N/A|N/A\n"  # no name bcm gives a node
        "garbage\n"
        "24|nlp|gpu05|cpu=1,node=1,gres/gpu=1|N/A|N/A\n"
    )
    assert slurm_usage.parse_running(out) == [NodeUsage("gpu05", "nlp", 1, 1)]


def test_gpu_counts_in_tres_strings() -> None:
    assert slurm_usage.alloc_gpus("cpu=8,mem=32G,node=2,billing=8,gres/gpu=4,gres/gpu:h100=4") == 4
    assert slurm_usage.alloc_gpus("cpu=8,gres/gpu:a100=1,gres/gpu:h100=2") == 3
    assert slurm_usage.alloc_gpus("cpu=1,node=1,billing=1") is None
    assert slurm_usage.alloc_gpus("cpu=1,gres/gpumem=10G") is None
    assert slurm_usage.requested_gpus("gres:gpu:h100:2") == 2
    assert slurm_usage.requested_gpus("gres/gpu:3,gres/nic:1") == 3
    assert slurm_usage.requested_gpus("gres:gpu:1,gres:gpu:a100:1") == 2
    assert slurm_usage.requested_gpus("N/A") is None


def _pod(
    ns: str, node: str | None, gpus: str | None = None, phase: str = "Running", queue: bool = False
) -> dict:  # type: ignore[type-arg]
    res = {"limits": {"nvidia.com/gpu": gpus}} if gpus is not None else {}
    labels = {k8t.QUEUE_LABEL: ns} if queue else {}
    return {
        "metadata": {"namespace": ns, "name": f"p-{ns}", "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "c", "resources": res}, {"name": "side"}]},
        "status": {"phase": phase},
    }


def test_running_pods_count_by_namespace_and_node() -> None:
    pods = [
        _pod("nlp", "gpu01", "2"),
        _pod("nlp", "gpu01", "1"),
        _pod("vision", "gpu02", None, queue=True),  # admitted through Kueue, no GPU: still the tenant
        _pod("kube-system", "gpu01"),  # a daemon on every node: no tenant
        _pod("nlp", "gpu02", "4", phase="Pending"),
        _pod("nlp", None, "1"),
    ]
    assert k8t.pod_usage(pods) == [NodeUsage("gpu01", "nlp", 3, 2), NodeUsage("gpu02", "vision", 0, 1)]


def test_a_sample_is_bounded_per_node_and_by_column() -> None:
    ids = {"gpu01": 1, "gpu02": 2}
    usage = [NodeUsage("gpu01", f"acct{i:02d}", i, 1) for i in range(TENANTS_PER_NODE + 4)]
    usage += [NodeUsage("gpu02", "x" * 200, 2**40, 1), NodeUsage("gpu02", "x" * 200, 1, 1)]
    usage += [NodeUsage("elsewhere", "nlp", 1, 1), NodeUsage("gpu02", "   ", 1, 1)]
    kept = bounded(usage, ids)
    gpu01 = sorted((a for n, a in kept if n == 1), reverse=True)
    assert len(gpu01) == TENANTS_PER_NODE and gpu01[0] == f"acct{TENANTS_PER_NODE + 3:02d}"  # most GPUs kept
    assert kept[(2, "x" * ACCOUNT_MAX)] == (2**31 - 1, 2)  # cut to the column, summed, capped at INT32
    assert {n for n, _ in kept} == {1, 2}
