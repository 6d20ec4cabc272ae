"""The lab itself: real sshd nodes in namespaces, reached with the real ssh client, and a clean teardown."""

from __future__ import annotations

import errno
import ipaddress
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bcm.lab import Lab, LabError, net, procs

NODES = 8
LabFactory = Callable[..., Lab]
Ssh = Callable[..., "subprocess.CompletedProcess[str]"]


def leftovers(lab: Lab, pids: list[int]) -> list[str]:
    """Everything of the lab still present on the host, described; [] when the teardown was clean."""
    found = [f"netns {ns}" for ns in net.netns_names() if ns == lab.netns or ns.startswith(lab.netns + "-")]
    found += [f"mount {point}" for point in procs.mounts_under(lab.state_dir)]
    found += [f"process {pid} ({procs.comm(pid)})" for pid in pids if procs.start_time(pid) is not None]
    found += [f"process {pid} rooted in the lab" for pid in procs.pids_rooted_under(lab.state_dir)]
    if net.link_exists(lab.host_if):
        found.append(f"link {lab.host_if}")
    if (lab.state_dir / "nodes").exists():
        found.append(f"directory {lab.state_dir / 'nodes'}")
    return found


def test_node_addresses_are_deterministic() -> None:
    subnet = ipaddress.IPv4Network("198.18.0.0/24")
    assert net.node_mac(1) == "52:54:00:18:00:01"
    assert net.node_mac(300) == "52:54:00:18:01:2c"
    assert str(net.node_address(subnet, 1)) == "198.18.0.11"
    assert net.max_nodes(subnet) == 244
    with pytest.raises(LabError):
        net.node_address(subnet, 245)


def test_lab_refuses_addresses_outside_the_benchmark_range(tmp_path: Path) -> None:
    with pytest.raises(LabError):
        Lab(tmp_path, "bcmbad", subnet="203.0.113.0/24")  # outside 198.18.0.0/15: refused


@pytest.mark.parametrize("name", ["", "Bcm", "bcm lab", "a-very-long-lab-name-x"])
def test_lab_refuses_names_unfit_for_namespaces(tmp_path: Path, name: str) -> None:
    with pytest.raises(LabError):
        Lab(tmp_path, name)


@pytest.mark.lab
def test_nodes_answer_ssh_with_their_own_identity(
    lab: LabFactory, lab_keypair: Any, lab_ssh: Ssh, tmp_path: Path
) -> None:
    built = lab(NODES, [lab_keypair.public])
    nodes = built.status()
    assert [node.name for node in nodes] == [f"node{i:02d}" for i in range(1, NODES + 1)]
    assert all(node.alive for node in nodes)
    assert len({node.host_key_public for node in nodes}) == NODES
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(built.known_hosts())

    for node in nodes:
        result = lab_ssh(
            node.ip,
            "hostname; cat /sys/class/net/eth0/address; ip -4 -o addr show dev eth0;"
            " ip -4 route show default; ip -6 route show default; echo $HOME;"
            " cat /proc/sys/net/ipv6/conf/eth0/accept_ra",
            known_hosts,
        )
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0] == node.name
        assert lines[1] == node.mac
        assert f"inet {node.ip}/24" in lines[2]
        assert lines[3:] == ["/root", "0"], "a node has a default route, a foreign home or takes RAs"

    for netns in [built.netns, *(node.netns for node in nodes)]:
        assert net.default_routes(netns) == [], netns
    host_routes = procs.run(["ip", "route", "show", "dev", built.host_if]).splitlines()
    assert [route.split()[0] for route in host_routes if route.strip()] == ["198.18.1.0/24"]


@pytest.mark.lab
def test_freeze_rekey_and_restart(lab: LabFactory, lab_keypair: Any, lab_ssh: Ssh, tmp_path: Path) -> None:
    built = lab(NODES, [lab_keypair.public])
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(built.known_hosts())

    frozen = built.freeze("node02")
    assert frozen.frozen
    hung = lab_ssh(frozen.ip, "true", known_hosts, timeout_s=2)
    assert hung.returncode == 255 and "banner exchange" in hung.stderr
    thawed = built.thaw("node02")
    assert not thawed.frozen
    assert lab_ssh(thawed.ip, "true", known_hosts).returncode == 0

    old_key = built.node("node03").host_key_public
    rekeyed = built.rekey("node03")
    assert rekeyed.alive and rekeyed.host_key_public != old_key
    refused = lab_ssh(rekeyed.ip, "true", known_hosts)
    assert refused.returncode == 255 and "REMOTE HOST IDENTIFICATION HAS CHANGED" in refused.stderr
    known_hosts.write_text(built.known_hosts())
    assert lab_ssh(rekeyed.ip, "hostname", known_hosts).stdout.strip() == "node03"

    killed = built.kill("node04")
    assert not killed.alive
    assert lab_ssh(killed.ip, "true", known_hosts).returncode == 255
    assert built.start("node04").alive
    assert built.run("node04", ["hostname"]).stdout.strip() == "node04"


@pytest.mark.lab
def test_down_leaves_nothing(lab_required: None, lab_keypair: Any, tmp_path: Path) -> None:
    lab = Lab(tmp_path / "state", "bcmdown", subnet="198.18.2.0/24")
    try:
        nodes = lab.up(3, [lab_keypair.public])
        pids = [pid for node in nodes for pid in (node.sshd_pid, node.parent_pid) if pid]
        assert len(pids) == 6
        assert leftovers(lab, pids) != []
        lab.down()
        assert leftovers(lab, pids) == []
        assert lab.status() == []
        # the lab's addresses now fail at once on this machine instead of leaving it
        assert refused_here(nodes[0].ip, 22) == errno.EHOSTUNREACH
        assert procs.run(["ip", "-4", "route", "show", "exact", net.LAB_SPACE]).startswith("unreachable")
    finally:
        lab.down()


def refused_here(address: str, port: int) -> int | None:
    """The errno a TCP connect to address gets (None if it connected)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)  # a bound, not a threshold: an unreachable route answers at once
        return sock.connect_ex((address, port))


@pytest.mark.parametrize("address", ["198.18.0.200", "198.19.255.254"])
def test_lab_space_without_a_lab_is_unreachable(lab_required: None, address: str) -> None:
    """With no lab on it, a 198.18.0.0/15 address gets "no route to host", never the default gateway."""
    route = subprocess.run(["ip", "-4", "route", "get", address], capture_output=True, text=True, check=False)
    assert route.returncode != 0 and "No route to host" in route.stderr, route.stdout + route.stderr
    assert refused_here(address, 22) == errno.EHOSTUNREACH
    with pytest.raises(OSError) as raised:
        socket.create_connection((address, 8470), timeout=30)
    assert raised.value.errno == errno.EHOSTUNREACH and "No route to host" in str(raised.value)


@pytest.mark.lab
def test_up_after_a_crash_cleans_leftovers(
    lab_required: None, lab_keypair: Any, lab_ssh: Ssh, tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"
    key_file = tmp_path / "key.pub"
    key_file.write_text(lab_keypair.public + "\n")
    lab = Lab(state_dir, "bcmcrash", subnet="198.18.3.0/24")
    try:
        # A first lab made by another process, which then "crashes" losing its state file, plus strays.
        subprocess.run(
            [
                sys.executable,
                "-m",
                "bcm.lab",
                "--state-dir",
                str(state_dir),
                "--name",
                "bcmcrash",
                "--subnet",
                "198.18.3.0/24",
                "up",
                "--nodes",
                "2",
                "--authorized-key",
                str(key_file),
            ],
            check=True,
            capture_output=True,
            timeout=600,
        )
        old = lab.status()
        old_pids = [pid for node in old for pid in (node.sshd_pid, node.parent_pid) if pid]
        assert len(old_pids) == 4 and all(node.alive for node in old)
        (state_dir / "state.json").unlink()
        procs.run(["ip", "netns", "add", "bcmcrash-stray"])
        procs.run(["mount", "-t", "tmpfs", "tmpfs", str(state_dir / "nodes" / "node01" / "root")])

        nodes = lab.up(2, [lab_keypair.public])

        assert all(procs.start_time(pid) is None for pid in old_pids)
        assert "bcmcrash-stray" not in net.netns_names()
        assert procs.mounts_under(state_dir) == []
        assert [node.alive for node in nodes] == [True, True]
        known_hosts = tmp_path / "known_hosts"
        known_hosts.write_text(lab.known_hosts())
        answer = lab_ssh(nodes[1].ip, "hostname", known_hosts)
        assert answer.stdout.strip() == "node02", answer.stderr
    finally:
        lab.down()
    assert leftovers(lab, []) == []
