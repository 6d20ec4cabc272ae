"""Names and addresses: hostlists (ClusterShell NodeSet), node names, MACs and IPs. Pure code."""

from __future__ import annotations

import ipaddress
import re

from ClusterShell.NodeSet import NodeSet, NodeSetParseError, RangeSetParseError

from bcm.errors import InvalidInput

MAX_HOSTLIST_NODES = 20000
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_MAC_RE = re.compile(r"^[0-9a-f]{2}([:-]?)[0-9a-f]{2}(\1[0-9a-f]{2}){4}$")


def check_name(name: str, field: str = "name") -> str:
    """A DNS-safe node/category name (RFC 1123 label, lower case)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidInput(
            f"{field}: {name!r} is not a valid name (lower-case letters, digits and '-', 1-63 chars,"
            " not starting or ending with '-')",
            field=field,
        )
    return name


def expand_hostlist(pattern: str, field: str = "nodes") -> list[str]:
    """Expand ``gpu[01-16],login1`` into names, in order; every name is checked."""
    if not pattern or not pattern.strip():
        raise InvalidInput(f"{field}: empty hostlist", field=field)
    try:
        nodeset = NodeSet(pattern)
    except (NodeSetParseError, RangeSetParseError, ValueError) as exc:
        raise InvalidInput(f"{field}: malformed hostlist {pattern!r}: {exc}", field=field) from None
    if len(nodeset) > MAX_HOSTLIST_NODES:
        raise InvalidInput(f"{field}: hostlist names more than {MAX_HOSTLIST_NODES} nodes", field=field)
    names = list(nodeset)
    for name in names:
        check_name(name, field)
    return names


def fold_hostlist(names: list[str]) -> str:
    """The compact hostlist of some names (``gpu[01-16]``)."""
    return str(NodeSet.fromlist(names)) if names else ""


def normalize_mac(mac: str, field: str = "mac") -> str:
    """``52-54-00-AA-BB-CC`` → ``52:54:00:aa:bb:cc``; anything else is InvalidInput."""
    value = mac.strip().lower() if isinstance(mac, str) else ""
    if not _MAC_RE.match(value):
        raise InvalidInput(f"{field}: {mac!r} is not a MAC address (like 52:54:00:00:00:01)", field=field)
    digits = value.replace(":", "").replace("-", "")
    if int(digits[:2], 16) & 1:
        raise InvalidInput(f"{field}: {mac!r} is a multicast MAC address", field=field)
    return ":".join(digits[i : i + 2] for i in range(0, 12, 2))


def normalize_ip(ip: str, field: str = "ip") -> str:
    """A unicast IPv4/IPv6 host address in canonical form."""
    try:
        addr = ipaddress.ip_address(ip.strip() if isinstance(ip, str) else ip)
    except ValueError:
        raise InvalidInput(f"{field}: {ip!r} is not an IP address", field=field) from None
    if addr.is_multicast or addr.is_unspecified:
        raise InvalidInput(f"{field}: {ip!r} is not a host address", field=field)
    return str(addr)


def mac_sequence(first: str, count: int, field: str = "mac") -> list[str]:
    """``count`` consecutive MACs starting at ``first`` (no wrap past ff:ff:ff:ff:ff:ff)."""
    start = int(normalize_mac(first, field).replace(":", ""), 16)
    end = start + count - 1
    # the first octet's low bit marks multicast; a range may cross into it (fe:ff:… + 1 = ff:00:…)
    if end > 0xFFFFFFFFFFFF or (end >> 40) & 1:
        raise InvalidInput(f"{field}: {count} consecutive MACs from {first} run past the unicast range", field=field)
    out = []
    for value in range(start, start + count):
        digits = f"{value:012x}"
        out.append(":".join(digits[i : i + 2] for i in range(0, 12, 2)))
    return out


def ip_sequence(first: str, count: int, field: str = "ip") -> list[str]:
    """``count`` consecutive addresses starting at ``first``."""
    addr = ipaddress.ip_address(normalize_ip(first, field))
    last_possible = 2**32 - 1 if addr.version == 4 else 2**128 - 1
    if int(addr) + count - 1 > last_possible:
        raise InvalidInput(
            f"{field}: {count} consecutive addresses from {first} run past the end", field=field
        )
    return [str(addr + i) for i in range(count)]
