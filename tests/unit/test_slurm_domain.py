"""The Slurm configuration model: GRES types, node lines, partitions, bad facts."""

from __future__ import annotations

import pytest

from bcm.domain.slurm import GpuSet, NodeInput, SlurmSettings, build_cluster, gres_type, slurm_node
from bcm.errors import InvalidInput

FACTS = {"cpu": {"sockets": 2, "cores": 64, "threads": 128}, "memory_bytes": 512 << 30}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100 80GB PCIe", "a100"),
        ("Tesla V100-SXM2-32GB", "v100"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA RTX A6000", "rtxa6000"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("Quadro RTX 8000", "rtx8000"),
        ("", "gpu"),
        (None, "gpu"),
        ("NVIDIA", "gpu"),
    ],
)
def test_gres_type_from_product_name(name: str | None, expected: str) -> None:
    assert gres_type(name) == expected


def test_node_line_has_topology_memory_and_gres() -> None:
    node = slurm_node(
        NodeInput("gpu01", "198.18.0.11", FACTS, [(i, "NVIDIA H100 80GB HBM3") for i in range(8)])
    )
    assert node.line() == (
        "NodeName=gpu01 NodeAddr=198.18.0.11 CPUs=128 Sockets=2 CoresPerSocket=32 ThreadsPerCore=2"
        " RealMemory=524288 Gres=gpu:h100:8 State=UNKNOWN"
    )


def test_uneven_topology_falls_back_to_cpu_count() -> None:
    facts = {"cpu": {"sockets": 3, "cores": 64, "threads": 128}, "memory_bytes": 1 << 30}
    line = slurm_node(NodeInput("n1", None, facts, [])).line()
    assert line == "NodeName=n1 CPUs=128 RealMemory=1024 State=UNKNOWN"


def test_mixed_gpu_types_and_gapped_indices() -> None:
    gpus = [
        (0, "NVIDIA A100-SXM4-80GB"),
        (2, "NVIDIA A100-SXM4-80GB"),
        (3, "NVIDIA A100-SXM4-80GB"),
        (1, "NVIDIA L40S"),
    ]
    node = slurm_node(NodeInput("n1", None, FACTS, gpus))
    assert node.gres == "gpu:a100:3,gpu:l40s:1"
    assert [g.files("/dev") for g in node.gpus] == ["/dev/nvidia[0,2-3]", "/dev/nvidia1"]
    assert GpuSet("h100", (0, 1, 2, 5, 6, 9)).files("/x/") == "/x/nvidia[0-2,5-6,9]"


def test_partitions_from_categories_plus_default() -> None:
    nodes = [
        NodeInput("a1", None, FACTS, [], "dgx"),
        NodeInput("a2", None, FACTS, [], "dgx"),
        NodeInput("b1", None, FACTS, [], "cpu"),
        NodeInput("c1", None, FACTS, [], None),
    ]
    cluster = build_cluster("c", "head", None, nodes, SlurmSettings())
    assert [p.line() for p in cluster.partitions] == [
        "PartitionName=all Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        "PartitionName=cpu Nodes=b1 Default=NO MaxTime=INFINITE State=UP",
        "PartitionName=dgx Nodes=a[1-2] Default=NO MaxTime=INFINITE State=UP",
    ]
    assert cluster.hostlist == "a[1-2],b1,c1"


def test_nodes_without_usable_facts_are_all_named() -> None:
    nodes = [
        NodeInput("a1", None, {}, []),
        NodeInput("a2", None, {"cpu": {"threads": 4}}, []),
        NodeInput("a3", None, FACTS, []),
    ]
    with pytest.raises(InvalidInput) as err:
        build_cluster("c", "head", None, nodes, SlurmSettings())
    assert "a1" in err.value.message and "a2" in err.value.message and "a3" not in err.value.message


@pytest.mark.parametrize("name", ["Prod", "1abc", "a-b", "x" * 41, "", "ab\n"])
def test_bad_cluster_names(name: str) -> None:
    with pytest.raises(InvalidInput):
        build_cluster(name, "head", None, [NodeInput("a", None, FACTS, [])], SlurmSettings())


@pytest.mark.parametrize(
    "bad",
    [
        {"gpu_device_dir": "relative/dir"},
        {"gpu_device_dir": "/dev/../etc"},
        {"gpu_device_dir": "/dev\nAutoDetect=nvml"},
        {"slurmd_parameters": "x\nSlurmUser=root"},
        {"task_plugin": "task/none\nX=1"},
        {"task_plugin": "task/none\n"},
        {"gpu_device_dir": "/dev\n"},
        {"storage_loc": "db; drop"},
        {"proctrack_type": "proctrack/evil"},
        {"unknown_knob": 1},
    ],
)
def test_settings_refuse_values_that_could_inject_config_lines(bad: dict) -> None:
    with pytest.raises(ValueError):
        SlurmSettings(**bad)
