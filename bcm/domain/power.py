"""Power control vocabulary and BMC settings: pure code, no I/O.

A node's BMC is reached at its own ``bmc_address``; protocol, user and password are inherited from
its category when the node does not set them (the password stays encrypted until a driver needs it).

A stored password is bound to the BMC it was set for (``target_key``: protocol, scheme, host, port).
Operators may change a node's address or protocol, but the password then stays unused until an admin
sets it again (``binding_refusal``): otherwise an operator could point the address at a host of their
own and have bcm send the admin's password there.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from bcm.errors import InvalidInput


class PowerState(StrEnum):
    ON = "on"
    """The BMC reports the machine powered on."""
    OFF = "off"
    """The BMC reports the machine powered off."""
    UNKNOWN = "unknown"
    """Never read, or the last read failed."""


class PowerAction(StrEnum):
    STATUS = "status"
    ON = "on"
    OFF = "off"
    SOFT_OFF = "soft-off"
    CYCLE = "cycle"
    PXE = "pxe"
    """Boot from the network once: set the next boot device to PXE, then power on or cycle."""

    @property
    def changes_power(self) -> bool:
        return self is not PowerAction.STATUS


class BootDevice(StrEnum):
    PXE = "pxe"
    DISK = "disk"


class BmcProtocol(StrEnum):
    IPMI = "ipmi"
    REDFISH = "redfish"


DEFAULT_PORTS = {BmcProtocol.IPMI: 623, BmcProtocol.REDFISH: 443}
# what a state leads us to expect of a node's power: these states mean "running its image"
SHOULD_BE_ON = frozenset({"booted", "ready", "draining", "drained"})
_HOSTNAME = re.compile(
    r"(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*"
)
_USER = re.compile(r"[A-Za-z0-9._@-]{1,64}")


@dataclass(frozen=True)
class BmcAddress:
    scheme: str | None  # "http" | "https" for Redfish URLs, None for a plain host
    host: str
    port: int | None

    def url(self, protocol: BmcProtocol) -> str:
        scheme = self.scheme or "https"
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = self.port or (DEFAULT_PORTS[protocol] if scheme == "https" else 80)
        return f"{scheme}://{host}:{port}"

    def display(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host + (f":{self.port}" if self.port else "")

    def is_plain_http(self, protocol: BmcProtocol) -> bool:
        return protocol is BmcProtocol.REDFISH and self.scheme == "http"


def target_key(protocol: BmcProtocol, address: BmcAddress) -> str:
    """The BMC a password is bound to, with default ports spelled out: ``ipmi://10.0.0.5:623``,
    ``redfish+https://bmc01:443``, ``redfish+http://10.0.0.6:8000``."""
    if protocol is BmcProtocol.IPMI:
        host = f"[{address.host}]" if ":" in address.host else address.host
        return f"ipmi://{host}:{address.port or DEFAULT_PORTS[protocol]}"
    return f"redfish+{address.url(protocol)}"


def binding_refusal(node: str, bound: str | None, current: str, category: str | None) -> str | None:
    """Why the node's stored BMC password must not be sent to ``current`` (None: it was set for it).

    ``category`` names the category the password comes from (None: the node's own password).
    """
    if bound == current:
        return None
    again = (
        f"bcm power set-category {category} --password-stdin, or bcm power set {node} --password-stdin"
        if category
        else f"bcm power set {node} --password-stdin"
    )
    whose = f"BMC credentials of {node}" + (f" (from category {category})" if category else "")
    if bound is None:
        was = (
            "were not set for it (it joined the category or got its BMC address later)"
            if category
            else "were set before bcm bound credentials to a BMC"
        )
        return f"{whose} {was}; its BMC is {current}: an admin must set them again ({again})"
    return f"{whose} were set for {bound}; its BMC is now {current}: an admin must set them again ({again})"


def plain_http_refusal(node: str, current: str, category: str | None) -> str:
    where = f"category {category}" if category else "a category"
    return (
        f"BMC of {node} is plain http ({current}): its password would cross the network unencrypted; "
        f"use an https address, or an admin allows plain http for {where} "
        f"(bcm power set-category {category or 'NAME'} --allow-http)"
    )


def parse_bmc_address(value: str) -> BmcAddress:
    """``host``, ``host:port``, ``[v6]:port`` or (Redfish) ``http(s)://host[:port]``; InvalidInput otherwise."""
    text = value.strip()
    scheme = None
    m = re.fullmatch(r"(https?)://([^/]+)/?", text)
    if m:
        scheme, text = m.group(1), m.group(2)
    port: int | None = None
    host = text
    v6 = re.fullmatch(r"\[([0-9a-fA-F:.]+)\](?::(\d{1,5}))?", text)
    if v6:
        host, port = v6.group(1), int(v6.group(2)) if v6.group(2) else None
    elif text.count(":") == 1:
        host, _, p = text.partition(":")
        if not p.isdigit():
            raise InvalidInput(f"bmc_address: bad port in {value!r}", field="bmc_address")
        port = int(p)
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        host = host.lower()
        if not _HOSTNAME.fullmatch(host):
            raise InvalidInput(
                f"bmc_address: {value!r} is not a host, host:port or http(s)://host[:port]",
                field="bmc_address",
            ) from None
    if port is not None and not 1 <= port <= 65535:
        raise InvalidInput(f"bmc_address: port {port} out of range 1-65535", field="bmc_address")
    return BmcAddress(scheme, host, port)


def check_bmc_address(value: str) -> str:
    parse_bmc_address(value)
    return value.strip()


def check_bmc_user(value: str) -> str:
    if not _USER.fullmatch(value):
        raise InvalidInput(
            "bmc_user: 1-64 letters, digits or . _ @ - (no spaces or control characters)", field="bmc_user"
        )
    return value


@dataclass(frozen=True)
class BmcTarget:
    """Everything a driver needs to reach one node's BMC. ``password`` is plain text: never log it."""

    node: str
    protocol: BmcProtocol
    address: BmcAddress
    user: str
    password: str = field(repr=False)
    tls_pin: str | None = None  # Redfish over https: sha256 of the BMC's certificate, pinned on first contact

    def describe(self) -> str:
        return f"node {self.node}: BMC {self.address.display()} ({self.protocol.value})"


def effective_bmc(node: dict[str, Any], category: dict[str, Any] | None) -> tuple[dict[str, Any], str | None]:
    """The node's BMC settings after inheritance (encrypted password included), and what is missing."""
    values: dict[str, Any] = {"bmc_address": node.get("bmc_address")}
    for key in ("bmc_protocol", "bmc_user", "bmc_password_enc"):
        own = node.get(key)
        values[key] = own if own is not None else (category or {}).get(key)
    if not values["bmc_address"]:
        return values, "no BMC address (set one with `bcm power set NODES --address …`)"
    if not values["bmc_protocol"]:
        return values, "no BMC protocol (ipmi or redfish) on the node or its category"
    if not values["bmc_user"] or not values["bmc_password_enc"]:
        return values, "no BMC user or password on the node or its category"
    return values, None


def check_bmc_protocol(value: str) -> str:
    try:
        return BmcProtocol(value).value
    except ValueError:
        raise InvalidInput(
            f"bmc_protocol: {value!r} is not one of ipmi, redfish", field="bmc_protocol"
        ) from None
