"""PXE provisioning: one-time boot tokens, and the API schemas of discovery, assignment and callback.

A boot token is minted once per provisioning attempt, when the node first fetches its iPXE script, and
bound to the client address that fetched it (with bcm's DHCP, that must be the MAC's lease). It is stored
hashed for lookup and encrypted (bcm.services.secrets) so that the same address fetching the script again
(a reboot) gets the same token; another address gets none and does not disturb it. It works only for that
node's MAC, only from the bound address, only while the node is provisioning and before ``expires_at``
(Ironic's rule for its agent token); the overlay that carries the host private key is sent once
(``overlay_at``). Using it at hello answers the node's long-lived agent token, once.
"""

from __future__ import annotations

import ipaddress
import re
from datetime import datetime
from typing import Literal

from pydantic import ValidationInfo, field_validator
from sqlalchemy import Text
from sqlmodel import Column, Field, SQLModel

from bcm.domain.facts import HardwareFacts
from bcm.domain.hostkey import check_host_key
from bcm.domain.naming import check_name, normalize_mac
from bcm.models.base import ts_column, utcnow


class BootToken(SQLModel, table=True):
    __tablename__ = "boot_token"

    id: int | None = Field(default=None, primary_key=True)
    node_id: int = Field(foreign_key="node.id", index=True, ondelete="CASCADE")
    mac: str = Field(max_length=17)
    token_hash: str = Field(max_length=64, unique=True, index=True)
    created_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))
    expires_at: datetime = Field(sa_column=ts_column(nullable=False))
    used_at: datetime | None = Field(default=None, sa_column=ts_column())
    client_address: str | None = Field(default=None, max_length=45)  # the first script fetch's socket address
    token_enc: str | None = Field(
        default=None, sa_column=Column(Text)
    )  # Fernet: the same token on a re-fetch
    overlay_at: datetime | None = Field(default=None, sa_column=ts_column())  # the overlay went out (once)


class PxeConfig(SQLModel, table=True):
    """PXE settings an admin set through the API (one row); they override BCM_PXE__* while it exists."""

    __tablename__ = "pxe_config"

    id: int | None = Field(default=None, primary_key=True)
    enabled: bool = False
    interface: str | None = Field(default=None, max_length=15)
    address: str | None = Field(default=None, max_length=45)
    mode: str = Field(default="dhcp", max_length=8)
    range_start: str | None = Field(default=None, max_length=45)
    range_end: str | None = Field(default=None, max_length=45)
    netmask: str = Field(default="255.255.255.0", max_length=45)
    router: str | None = Field(default=None, max_length=45)
    updated_by: str | None = Field(default=None, max_length=64)
    updated_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))


class PxeConfigUpdate(SQLModel):
    """``bcm pxe enable|disable``: what changes; unset fields keep their values."""

    enabled: bool
    interface: str | None = Field(default=None, min_length=1, max_length=15)
    address: str | None = Field(default=None, max_length=45)
    mode: Literal["dhcp", "proxy"] | None = None
    range_start: str | None = Field(default=None, max_length=45)
    range_end: str | None = Field(default=None, max_length=45)
    netmask: str | None = Field(default=None, max_length=45)
    router: str | None = Field(default=None, max_length=45)

    @field_validator("interface")
    @classmethod
    def _interface(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9_.:-]{1,15}", v):
            raise ValueError("interface: an interface name (letters, digits, _ . : -; at most 15)")
        return v

    @field_validator("address", "range_start", "range_end", "netmask", "router")
    @classmethod
    def _ipv4(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        try:
            return str(ipaddress.IPv4Address(v))
        except ValueError:
            raise ValueError(f"{info.field_name}: {v[:45]!r} is not an IPv4 address") from None


class PxeStatus(SQLModel):
    enabled: bool
    source: str  # "api" (bcm pxe enable) or "settings" (BCM_PXE__*)
    interface: str | None
    address: str | None
    mode: str
    range_start: str | None
    range_end: str | None
    netmask: str
    router: str | None
    server_url: str
    dnsmasq_pid: int | None = None
    dnsmasq_restarts: int = 0


class DiscoveredBmc(SQLModel):
    """The machine's own BMC as the discovery image found it (ipmitool's LAN print on the node; a lab VM's SMBIOS OEM
    string ``bcm.bmc=<protocol>:<address>``). Claimed by an unauthenticated client: bcm sends a password only
    where its category's admin-set range holds the address, and never powers a BMC another node has."""

    protocol: str = Field(max_length=16)
    address: str = Field(max_length=270)

    @field_validator("protocol")
    @classmethod
    def _protocol(cls, v: str) -> str:
        from bcm.domain.power import check_bmc_protocol

        return check_bmc_protocol(v)

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        from bcm.domain.power import check_bmc_address

        return check_bmc_address(v)


class DiscoveryReport(SQLModel):
    """What a machine booted into the discovery image posts: its boot MAC and what it found."""

    mac: str
    facts: HardwareFacts
    bmc: DiscoveredBmc | None = None

    @field_validator("mac")
    @classmethod
    def _mac(cls, v: str) -> str:
        return normalize_mac(v)


class DiscoveryAccepted(SQLModel):
    node: str
    state: str
    assigned: bool = False
    provisioning: bool = (
        False  # its category provisions it at once (zero-touch): it powers off, bcm powers it on
    )


class HelloRequest(SQLModel):
    """A booted node's first call: its boot MAC and its SSH host public key (pinned when its category's
    ``host_key_source`` is ``node``); the one-time token travels as the bearer token. The node's address
    is the connection's, never a field or a header."""

    mac: str
    host_key: str | None = Field(default=None, max_length=16384)

    @field_validator("mac")
    @classmethod
    def _mac(cls, v: str) -> str:
        return normalize_mac(v)

    @field_validator("host_key")
    @classmethod
    def _host_key(cls, v: str | None) -> str | None:
        return None if v is None else check_host_key(v, "host_key")


class BootFailure(SQLModel):
    """The image's init could not boot the node (the root image's checksum, a fetch, a mount): its one line,
    sent with the attempt's one-time token, fails the node at once instead of at the provisioning deadline."""

    mac: str
    message: str = Field(min_length=1, max_length=500)

    @field_validator("mac")
    @classmethod
    def _mac(cls, v: str) -> str:
        return normalize_mac(v)

    @field_validator("message")
    @classmethod
    def _message(cls, v: str) -> str:
        return "".join(c if c.isprintable() else " " for c in v).strip() or "(no message)"


class InstallDone(SQLModel):
    """The image's init installed (or synced) the disk and synced it: sent with the one-time token, last."""

    mac: str
    image: str = Field(min_length=1, max_length=200)
    layout: str = Field(min_length=1, max_length=16)
    mode: Literal["full", "auto"]
    bytes_written: int | None = Field(default=None, ge=0, le=1 << 60)

    @field_validator("mac")
    @classmethod
    def _mac(cls, v: str) -> str:
        return normalize_mac(v)

    @field_validator("layout")
    @classmethod
    def _layout(cls, v: str) -> str:
        if not re.fullmatch(r"[0-9a-f]{1,16}", v):
            raise ValueError("the layout's hash (BCM_LAYOUT of the plan)")
        return v


class DiskHello(SQLModel):
    """A system booted from its disk calls back: its boot MAC; its agent token is the bearer token."""

    mac: str

    @field_validator("mac")
    @classmethod
    def _mac(cls, v: str) -> str:
        return normalize_mac(v)


class HelloAnswer(SQLModel):
    node: str
    state: str
    agent_token: str


class AssignRequest(SQLModel):
    """Accept a discovered machine: give it its name (and category, image) and make it registered."""

    mac: str
    name: str = Field(max_length=63)
    category: str | None = Field(default=None, max_length=63)
    image: str | None = Field(default=None, max_length=128)

    @field_validator("mac")
    @classmethod
    def _mac(cls, v: str) -> str:
        return normalize_mac(v)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v)


class DiscoveredPublic(SQLModel):
    """A discovered machine as `bcm node discovered` lists it."""

    name: str
    mac: str | None
    cpu_model: str | None = None
    threads: int | None = None
    memory_bytes: int | None = None
    disks: int = 0
    nvidia_pci_devices: int = 0
    product: str | None = None
    discovered_at: datetime
    updated_at: datetime
