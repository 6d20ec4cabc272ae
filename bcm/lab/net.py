"""The lab's network, made with iproute2: an isolated bridge namespace, the head's veth, node veths.

Nothing here adds a route other than the connected /24, so no lab namespace can reach past the bridge.
Commands for many nodes go through `ip -batch` so that 100 nodes cost a handful of processes.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bcm.lab import procs
from bcm.lab.errors import LabError

NETNS_DIR = Path("/run/netns")
BRIDGE = "br0"
BRIDGE_MAC = "52:54:00:18:fe:00"
HOST_MAC = "52:54:00:18:fe:01"
HOST_PEER_MAC = "52:54:00:18:fe:02"
HOST_PEER = "prov"
FIRST_HOST = 10  # node i gets host number FIRST_HOST + i; .1 is the head, .2-.10 stay free
LAB_SPACE = "198.18.0.0/15"  # every lab subnet lies inside; never routed off this machine


@dataclass(frozen=True)
class NodeLink:
    """One node's wiring: its namespace, the veth ends and the node side's MAC and address."""

    netns: str
    bridge_port: str
    mac: str
    port_mac: str
    address: str  # with prefix length, e.g. 198.18.0.11/24


def node_mac(index: int) -> str:
    """Deterministic MAC of node index (1-based) on the node side."""
    return f"52:54:00:18:{index >> 8:02x}:{index & 0xFF:02x}"


def port_mac(index: int) -> str:
    """Deterministic MAC of the bridge-side end of node index's veth."""
    return f"52:54:00:19:{index >> 8:02x}:{index & 0xFF:02x}"


def node_address(subnet: ipaddress.IPv4Network, index: int) -> ipaddress.IPv4Address:
    address = subnet.network_address + FIRST_HOST + index
    if address not in subnet or address == subnet.broadcast_address:
        raise LabError(f"node {index} does not fit in {subnet}: at most {max_nodes(subnet)} nodes")
    return address


def max_nodes(subnet: ipaddress.IPv4Network) -> int:
    return subnet.num_addresses - FIRST_HOST - 2


def head_address(subnet: ipaddress.IPv4Network) -> ipaddress.IPv4Address:
    return subnet.network_address + 1


def netns_names() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def link_exists(name: str) -> bool:
    return Path(f"/sys/class/net/{name}").exists()


def keep_lab_space_local() -> None:
    """``ip route replace unreachable 198.18.0.0/15`` in the host namespace; idempotent, never removed.

    Without it, a lab address used while no lab is up (an inventory, an agent report, a CLI pointed
    at a lab node) is routed out through the default gateway. With it, such a connection fails at
    once with EHOSTUNREACH; a lab's own /24 is more specific and still reaches its nodes.
    """
    current = procs.run(["ip", "-4", "route", "show", "exact", LAB_SPACE])
    if not current.strip().startswith("unreachable"):
        procs.run(["ip", "-4", "route", "replace", "unreachable", LAB_SPACE])


def fit_neighbour_table(nodes: int) -> None:
    """Room in the host's ARP table for every node on the head's veth; raised, never lowered.

    The kernel's defaults (gc_thresh2 512, gc_thresh3 1024) are shared by every interface: a lab of a
    thousand nodes would overflow them ("neighbour table overflow"), and connects fail for no fault of
    the node.
    """
    need = nodes + 256
    for name, want in (("gc_thresh2", need), ("gc_thresh3", 2 * need)):
        path = Path("/proc/sys/net/ipv4/neigh/default") / name
        if int(path.read_text()) < want:
            path.write_text(f"{want}\n")


def create_network(netns: str, host_if: str, subnet: ipaddress.IPv4Network) -> None:
    """The bridge namespace with br0 (no STP, no forwarding delay) and the head's veth into it."""
    host_addr = f"{head_address(subnet)}/{subnet.prefixlen}"
    procs.run(["ip", "netns", "add", netns])
    procs.run(
        ["ip", "-n", netns, "-batch", "-"],
        stdin=(
            "link set lo up\n"
            f"link add {BRIDGE} address {BRIDGE_MAC} type bridge stp_state 0 forward_delay 0\n"
            f"link set {BRIDGE} up\n"
        ),
    )
    procs.run(
        [
            "ip",
            "link",
            "add",
            host_if,
            "address",
            HOST_MAC,
            "type",
            "veth",
            "peer",
            "name",
            HOST_PEER,
            "address",
            HOST_PEER_MAC,
            "netns",
            netns,
        ]
    )
    procs.run(["ip", "-n", netns, "link", "set", HOST_PEER, "master", BRIDGE, "up"])
    procs.run(["ip", "addr", "add", host_addr, "dev", host_if])
    procs.run(["ip", "link", "set", host_if, "up"])


def add_nodes(netns: str, links: Sequence[NodeLink], parallel: int = 4) -> None:
    """Make each node's namespace and veth pair, the node end named eth0 and addressed."""
    if not links:
        return
    procs.run(["ip", "-batch", "-"], stdin="".join(f"netns add {link.netns}\n" for link in links))
    procs.run(
        ["ip", "-n", netns, "-batch", "-"],
        stdin="".join(
            f"link add {link.bridge_port} address {link.port_mac} type veth"
            f" peer name eth0 address {link.mac} netns {link.netns}\n"
            f"link set {link.bridge_port} master {BRIDGE} up\n"
            for link in links
        ),
    )

    def configure(link: NodeLink) -> None:
        procs.run(
            ["ip", "-n", link.netns, "-batch", "-"],
            stdin=f"link set lo up\naddr add {link.address} dev eth0\nlink set eth0 up\n",
        )

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        list(pool.map(configure, links))


def flush_neighbours(netns: str, host_if: str) -> None:
    """Forget learned MAC/IP pairs, so reused addresses are not sent to a previous lab's MACs."""
    if (NETNS_DIR / netns).exists():
        procs.run(["ip", "-n", netns, "neigh", "flush", "dev", BRIDGE])
    if link_exists(host_if):
        procs.run(["ip", "neigh", "flush", "dev", host_if])


def default_routes(netns: str) -> list[str]:
    """Default routes (IPv4 and IPv6) in a namespace; the lab must have none."""
    found = []
    for family in ("-4", "-6"):
        out = procs.run(["ip", "-n", netns, family, "route", "show", "default"])
        found += [line for line in out.splitlines() if line.strip()]
    return found


def delete_netns(names: Sequence[str]) -> None:
    if names:
        procs.run(["ip", "-batch", "-"], stdin="".join(f"netns del {name}\n" for name in names))


def delete_link(name: str) -> None:
    if link_exists(name):
        procs.run(["ip", "link", "del", name])
