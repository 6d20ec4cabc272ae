"""Names and addresses: hostlists (ClusterShell NodeSet), node names, MACs and IPs. Pure code.

Hostlists are parsed by our own strict grammar first (names, ``[ranges]`` and commas only) and their
size is computed from the ranges before anything is expanded; only then does ClusterShell's NodeSet
expand them, with group resolution switched off. ClusterShell's default group resolver runs shell
commands from ``groups.conf`` with the group name in them, so ``@group`` is refused, never resolved.
"""

from __future__ import annotations

import ipaddress
import re

from ClusterShell.NodeSet import RESOLVER_NOGROUP, NodeSet, NodeSetParseError, RangeSetParseError

from bcm.errors import InvalidInput

MAX_HOSTLIST_NODES = 20000
# ClusterShell asserts (an AssertionError, a 500) on a range spanning 10^9 numbers or more, steps or not
MAX_RANGE_SPAN = 999_999_999
MAX_HOSTLIST_CHARS = 65535
_NAME_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_MAC_RE = re.compile(r"[0-9a-f]{2}([:-]?)[0-9a-f]{2}(\1[0-9a-f]{2}){4}")
# one comma-separated element: literal name characters and bracketed range lists, e.g. gpu[01-16]-ib[0-1]
_ELEMENT_RE = re.compile(r"(?:[A-Za-z0-9_.-]+|\[[0-9,/-]+\])+")
_BRACKET_RE = re.compile(r"\[([0-9,/-]+)\]")
_RANGE_RE = re.compile(r"([0-9]{1,9})(?:-([0-9]{1,9}))?(?:/([0-9]{1,9}))?")


def check_name(name: str, field: str = "name") -> str:
    """A DNS-safe node/category name (RFC 1123 label, lower case)."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidInput(
            f"{field}: {_shown(name)} is not a valid name (lower-case letters, digits and '-', 1-63 chars,"
            " not starting or ending with '-')",
            field=field,
        )
    return name


def _shown(value: object, limit: int = 64) -> str:
    """A user's value quoted for an error message, cut short so an error never echoes a whole body."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _split_top(pattern: str) -> list[str]:
    """Split at the commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(pattern):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
    parts.append(pattern[start:])
    return parts


def hostlist_size(pattern: str, field: str = "nodes") -> int:
    """How many names a hostlist can name at most, computed from its ranges without expanding them.

    Raises InvalidInput for anything outside the grammar: names, ``[a-b/step,c]`` ranges and commas.
    Groups (``@name``) and ClusterShell's set operators (``!``, ``&``, ``^``) are refused.
    """
    if not isinstance(pattern, str) or not pattern.strip():
        raise InvalidInput(f"{field}: empty hostlist", field=field)
    if len(pattern) > MAX_HOSTLIST_CHARS:
        raise InvalidInput(f"{field}: hostlist longer than {MAX_HOSTLIST_CHARS} characters", field=field)
    if "@" in pattern:
        raise InvalidInput(
            f"{field}: node groups (@name) are not supported; name the nodes, e.g. gpu[01-16]", field=field
        )
    total = 0
    for element in _split_top(pattern):
        if not _ELEMENT_RE.fullmatch(element):
            raise InvalidInput(
                f"{field}: malformed hostlist {_shown(pattern)}: use names, [ranges] and commas,"
                " e.g. gpu[01-16],login1",
                field=field,
            )
        size = 1
        for body in _BRACKET_RE.findall(element):
            size *= _ranges_size(body, pattern, field)
            if size > MAX_HOSTLIST_NODES:
                break
        total += size
        if total > MAX_HOSTLIST_NODES:
            raise InvalidInput(f"{field}: hostlist names more than {MAX_HOSTLIST_NODES} nodes", field=field)
    return total


def _ranges_size(body: str, pattern: str, field: str) -> int:
    count = 0
    for item in body.split(","):
        m = _RANGE_RE.fullmatch(item)
        if not m:
            raise InvalidInput(f"{field}: malformed range [{_shown(body)[1:-1]}] in a hostlist", field=field)
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        step = int(m.group(3)) if m.group(3) is not None else 1
        if hi < lo or step < 1:
            raise InvalidInput(f"{field}: range {item!r} runs backwards or has a zero step", field=field)
        if hi - lo >= MAX_RANGE_SPAN:
            raise InvalidInput(
                f"{field}: range {item!r} spans {MAX_RANGE_SPAN:,} numbers or more; name smaller ranges",
                field=field,
            )
        count += (hi - lo) // step + 1
        if count > MAX_HOSTLIST_NODES:
            break
    return count


def expand_hostlist(pattern: str, field: str = "nodes") -> list[str]:
    """Expand ``gpu[01-16],login1`` into names, in order; every name is checked.

    Every endpoint and the CLI take hostlists through this function (the size is bounded first).
    """
    hostlist_size(pattern, field)
    try:
        nodeset = NodeSet(pattern, resolver=RESOLVER_NOGROUP)
    except (NodeSetParseError, RangeSetParseError, ValueError, AssertionError):
        # ClusterShell states some of its limits as assertions; each is the user's input, never a 500
        raise InvalidInput(f"{field}: malformed hostlist {_shown(pattern)}", field=field) from None
    names = list(nodeset)
    for name in names:
        check_name(name, field)
    return names


def fold_hostlist(names: list[str]) -> str:
    """The compact hostlist of some names (``gpu[01-16]``); names that are not node names are listed as given."""
    if not all(isinstance(n, str) and _NAME_RE.fullmatch(n) for n in names):
        return ",".join(_shown(n) for n in names[:20]) + (",..." if len(names) > 20 else "")
    return str(NodeSet.fromlist(names, resolver=RESOLVER_NOGROUP)) if names else ""


def normalize_mac(mac: str, field: str = "mac") -> str:
    """``52-54-00-AA-BB-CC`` → ``52:54:00:aa:bb:cc``; anything else is InvalidInput."""
    value = mac.strip().lower() if isinstance(mac, str) else ""
    if not _MAC_RE.fullmatch(value):
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
        raise InvalidInput(
            f"{field}: {count} consecutive MACs from {first} run past the unicast range", field=field
        )
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
