"""Nodes and their network interfaces, with the API schema family for each."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import field_validator, model_validator
from sqlalchemy import BigInteger, Text
from sqlmodel import Column, Field, SQLModel

from bcm.domain.hostkey import check_host_key
from bcm.domain.kernel_args import check_kernel_args
from bcm.domain.naming import check_name, normalize_ip, normalize_mac
from bcm.domain.power import check_bmc_address, check_bmc_protocol, check_bmc_user
from bcm.domain.states import State
from bcm.models.base import json_column, ts_column, utcnow


class Interface(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    node_id: int = Field(foreign_key="node.id", index=True, ondelete="CASCADE")
    name: str = Field(default="eth0", max_length=15)
    mac: str | None = Field(default=None, max_length=17, unique=True, index=True)
    ip: str | None = Field(default=None, max_length=45, unique=True, index=True)
    boot: bool = True


class InterfaceSpec(SQLModel):
    name: str = Field(default="eth0", min_length=1, max_length=15)
    mac: str | None = None
    ip: str | None = None
    boot: bool = True

    @field_validator("mac")
    @classmethod
    def _mac(cls, v: str | None) -> str | None:
        return None if v is None else normalize_mac(v)

    @field_validator("ip")
    @classmethod
    def _ip(cls, v: str | None) -> str | None:
        return None if v is None else normalize_ip(v)


class NodeSettings(SQLModel):
    """Fields a node may set to override its category."""

    image: str | None = Field(default=None, max_length=128)
    kernel_args: str | None = Field(default=None, max_length=1024)
    wlm_role: str | None = Field(default=None, max_length=32)
    boot_mode: str | None = Field(default=None, max_length=16)
    comment: str | None = Field(default=None, max_length=1024)
    bmc_address: str | None = Field(default=None, max_length=270)
    bmc_protocol: str | None = Field(default=None, max_length=16)  # ipmi | redfish
    bmc_user: str | None = Field(default=None, max_length=64)

    @field_validator("kernel_args")
    @classmethod
    def _kernel_args(cls, v: str | None) -> str | None:
        return None if v is None else check_kernel_args(v)

    @field_validator("bmc_address")
    @classmethod
    def _bmc_address(cls, v: str | None) -> str | None:
        return None if v is None else check_bmc_address(v)

    @field_validator("bmc_user")
    @classmethod
    def _bmc_user(cls, v: str | None) -> str | None:
        return None if v is None else check_bmc_user(v)

    @field_validator("bmc_protocol")
    @classmethod
    def _bmc_protocol(cls, v: str | None) -> str | None:
        return None if v is None else check_bmc_protocol(v)


class Node(NodeSettings, table=True):
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=63, unique=True, index=True)
    category_id: int | None = Field(default=None, foreign_key="category.id", index=True)
    provision_state: str = Field(default=State.REGISTERED, max_length=16, index=True)
    target_state: str | None = Field(default=None, max_length=16)
    last_error: str | None = Field(default=None, sa_column=Column(Text))
    wlm_state: str | None = Field(default=None, max_length=32)
    ssh_host_key: str | None = Field(default=None, sa_column=Column(Text))
    facts: dict[str, Any] | None = Field(default=None, sa_column=json_column())
    lock_owner: str | None = Field(default=None, max_length=64)
    lock_expires: datetime | None = Field(default=None, sa_column=ts_column())
    created_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))
    updated_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))
    inventoried_at: datetime | None = Field(default=None, sa_column=ts_column())
    bmc_password_enc: str | None = Field(default=None, sa_column=Column(Text))  # Fernet, see services.secrets
    # the BMC (bcm.domain.power.target_key) the node's own password was set for; elsewhere it is not sent
    bmc_password_target: str | None = Field(default=None, max_length=300)
    bmc_tls_pin: str | None = Field(
        default=None, max_length=64
    )  # Redfish https: sha256 of the BMC's certificate
    power_state: str | None = Field(default=None, max_length=16)
    power_checked_at: datetime | None = Field(default=None, sa_column=ts_column())
    running_image: str | None = Field(default=None, max_length=200)  # "<image>:<version>" last pushed
    image_pushed_at: datetime | None = Field(default=None, sa_column=ts_column())
    # PXE provisioning (bcm.services.pxe): the host key bcm made for the node's overlay (Fernet, private
    # part; the public part is pinned in ssh_host_key), and the node's place in the provisioning queue
    host_key_enc: str | None = Field(default=None, sa_column=Column(Text))
    provision_queued_at: datetime | None = Field(default=None, sa_column=ts_column())
    provision_started_at: datetime | None = Field(default=None, sa_column=ts_column())
    provision_deadline: datetime | None = Field(default=None, sa_column=ts_column())
    # install to disk (#30, bcm.domain.disk_layout): the node's own mode (else its category's), one boot's
    # mode (cleared when that boot calls back), a data node refuses `full` unless an admin confirmed the wipe
    install_mode: str | None = Field(default=None, max_length=8)
    next_install_mode: str | None = Field(default=None, max_length=8)
    data_node: bool = False
    wipe_confirmed: bool = False
    # what the disk holds: "installing" from the moment the installer may touch it, "installed" only once
    # everything is synced (so a power cut during `full` installs again at the next boot)
    install_state: str | None = Field(default=None, max_length=16)
    installed_image: str | None = Field(default=None, max_length=200)
    installed_layout: str | None = Field(default=None, max_length=16)
    installed_at: datetime | None = Field(default=None, sa_column=ts_column())
    install_bytes: int | None = Field(
        default=None, sa_column=Column(BigInteger)
    )  # the last install/sync wrote
    # what runs: the image version its last boot called back with, from "network" (stateless) or "disk"
    booted_image: str | None = Field(default=None, max_length=200)
    booted_from: str | None = Field(default=None, max_length=8)


class NodeCreate(NodeSettings):
    name: str = Field(max_length=63)
    category: str | None = Field(default=None, max_length=63)
    mac: str | None = None
    ip: str | None = None
    interfaces: list[InterfaceSpec] = Field(default_factory=list, max_length=16)
    ssh_host_key: str | None = Field(default=None, max_length=16384)
    state: State = State.REGISTERED

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v)

    @field_validator("ssh_host_key")
    @classmethod
    def _host_key(cls, v: str | None) -> str | None:
        return None if v is None else check_host_key(v)

    @field_validator("mac")
    @classmethod
    def _mac(cls, v: str | None) -> str | None:
        return None if v is None else normalize_mac(v)

    @field_validator("ip")
    @classmethod
    def _ip(cls, v: str | None) -> str | None:
        return None if v is None else normalize_ip(v)

    @field_validator("state")
    @classmethod
    def _state(cls, v: State) -> State:
        if v not in (State.REGISTERED, State.DISCOVERED):
            raise ValueError("a new node starts as registered or discovered")
        return v

    @model_validator(mode="after")
    def _one_way_to_say_interfaces(self) -> NodeCreate:
        if self.interfaces and (self.mac or self.ip):
            raise ValueError("give either mac/ip or interfaces, not both")
        return self

    def interface_specs(self) -> list[InterfaceSpec]:
        if self.interfaces:
            return list(self.interfaces)
        if self.mac or self.ip:
            return [InterfaceSpec(mac=self.mac, ip=self.ip)]
        return []


class NodeBulkCreate(NodeSettings):
    """Many nodes from a hostlist; MACs and IPs count up from the first ones given."""

    nodes: str = Field(max_length=65535)
    category: str | None = Field(default=None, max_length=63)
    mac: str | None = None
    ip: str | None = None

    @field_validator("mac")
    @classmethod
    def _mac(cls, v: str | None) -> str | None:
        return None if v is None else normalize_mac(v)

    @field_validator("ip")
    @classmethod
    def _ip(cls, v: str | None) -> str | None:
        return None if v is None else normalize_ip(v)


class NodeUpdate(NodeSettings):
    category: str | None = Field(default=None, max_length=63)
    interfaces: list[InterfaceSpec] | None = Field(default=None, max_length=16)
    ssh_host_key: str | None = Field(
        default=None, description="refused: a pinned host key changes only through POST /nodes/{name}/rekey"
    )

    @field_validator("ssh_host_key")
    @classmethod
    def _no_host_key(cls, v: str | None) -> str | None:
        raise ValueError("a pinned host key changes only through `bcm node rekey NODE` (admin)")


class RekeyRequest(SQLModel):
    """Replace a node's pinned SSH host key, or clear it (``null``) so the next contact pins anew."""

    ssh_host_key: str | None = Field(default=None, max_length=16384)

    @field_validator("ssh_host_key")
    @classmethod
    def _host_key(cls, v: str | None) -> str | None:
        return None if v is None else check_host_key(v)


class InterfacePublic(SQLModel):
    name: str
    mac: str | None
    ip: str | None
    boot: bool


class TenantUse(SQLModel):
    """An account running work on a node, as the workload-manager sync last sampled it."""

    account: str
    gpus: int
    jobs: int


class NodePublic(NodeSettings):
    name: str
    category: str | None
    provision_state: str
    target_state: str | None
    last_error: str | None
    wlm_state: str | None
    interfaces: list[InterfacePublic]
    gpu_count: int = 0
    locked_by: str | None = None
    effective: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime
    updated_at: datetime
    inventoried_at: datetime | None = None
    power_state: str | None = None
    running_image: str | None = None  # the image version last pushed to it (`bcm image push --apply`)
    tenants: list[TenantUse] = Field(default_factory=list)  # most GPUs first (the last workload-manager sync)
    install_mode: str | None = None
    next_install_mode: str | None = None
    data_node: bool = False
    wipe_confirmed: bool = False
    install_state: str | None = None
    installed_image: str | None = None
    installed_at: datetime | None = None
    install_bytes: int | None = None
    booted_image: str | None = None
    booted_from: str | None = None


class NodeInstallUpdate(SQLModel):
    """``PUT /nodes/{name}/install``: unset fields keep their values; ``install_mode: null`` inherits again.
    ``confirm_wipe`` (admin only) lets a data node take a ``full`` install once."""

    install_mode: str | None = Field(default=None, max_length=16)
    next_install_mode: str | None = Field(default=None, max_length=16)
    data_node: bool | None = None
    confirm_wipe: bool = False

    @field_validator("install_mode", "next_install_mode")
    @classmethod
    def _mode(cls, v: str | None, info: Any) -> str | None:
        from bcm.domain.disk_layout import check_install_mode

        return check_install_mode(v, info.field_name)


class NodePage(SQLModel):
    items: list[NodePublic]
    total: int
    limit: int
    offset: int


class VerbRequest(SQLModel):
    nodes: str = Field(max_length=65535)
    reason: str | None = Field(default=None, max_length=512)
    # provision/reimage only, admin only: bcm makes new SSH host keys (else a pinned key is kept)
    rekey: bool = False


class VerbResult(SQLModel):
    verb: str
    nodes: list[dict[str, Any]]
    operation_id: int | None = None
