"""Categories: named defaults that nodes inherit (BCM's word; Warewulf says profile)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from pydantic import field_validator
from sqlalchemy import Text
from sqlmodel import Column, Field, SQLModel

from bcm.domain.health_policy import HealthPolicy
from bcm.domain.kernel_args import check_kernel_args
from bcm.domain.naming import check_name
from bcm.domain.power import check_bmc_protocol, check_bmc_user
from bcm.errors import InvalidInput
from bcm.models.base import json_column, ts_column, utcnow

HOST_KEY_SOURCES = ("bcm", "node")


class CategoryBase(SQLModel):
    image: str | None = Field(default=None, max_length=128)
    kernel_args: str | None = Field(default=None, max_length=1024)
    wlm_role: str | None = Field(default=None, max_length=32)
    boot_mode: str | None = Field(default=None, max_length=16)
    description: str | None = Field(default=None, max_length=1024)
    bmc_protocol: str | None = Field(default=None, max_length=16)  # ipmi | redfish
    bmc_user: str | None = Field(default=None, max_length=64)
    # PXE discovery rule: a discovered machine whose MAC starts with the prefix is assigned the first free
    # name of the hostlist, in this category, at once (no `bcm node assign`)
    discover_mac_prefix: str | None = Field(default=None, max_length=17)
    discover_names: str | None = Field(default=None, max_length=1024)
    # who makes a provisioned node's SSH host key: "bcm" (default; sent in the overlay, pinned before the
    # first boot) or "node" (for untrusted boot networks: no private key travels; bcm pins the public key
    # the node presents at hello)
    host_key_source: str | None = Field(default=None, max_length=8)
    # zero-touch: a machine its discovery rule names is provisioned at once (its BMC reported by the discovery
    # image and usable: see the category's BMC password range); booted and inventoried, it joins the workload-
    # manager cluster named here and becomes ready once a one-node verification job passed there
    auto_provision: bool | None = None
    wlm_cluster: str | None = Field(default=None, max_length=40)

    @field_validator("kernel_args")
    @classmethod
    def _kernel_args(cls, v: str | None) -> str | None:
        return None if v is None else check_kernel_args(v)

    @field_validator("host_key_source")
    @classmethod
    def _host_key_source(cls, v: str | None) -> str | None:
        if v is not None and v not in HOST_KEY_SOURCES:
            raise InvalidInput(
                f"host_key_source: {v[:16]!r} is not one of {', '.join(HOST_KEY_SOURCES)}",
                field="host_key_source",
            )
        return v

    @field_validator("discover_mac_prefix")
    @classmethod
    def _mac_prefix(cls, v: str | None) -> str | None:
        if v is None:
            return None
        value = v.strip().lower().replace("-", ":")
        if not re.fullmatch(r"[0-9a-f]{2}(:[0-9a-f]{2}){0,5}", value):
            raise ValueError(
                f"discover_mac_prefix: {v[:17]!r} is not a MAC prefix (1-6 octets, like 52:54:00)"
            )
        return value

    @field_validator("discover_names")
    @classmethod
    def _names(cls, v: str | None) -> str | None:
        if v is None:
            return None
        from bcm.domain.naming import expand_hostlist

        for name in expand_hostlist(v, "discover_names"):
            check_name(name, "discover_names")
        return v

    @field_validator("bmc_protocol")
    @classmethod
    def _bmc_protocol(cls, v: str | None) -> str | None:
        return None if v is None else check_bmc_protocol(v)

    @field_validator("wlm_cluster")
    @classmethod
    def _wlm_cluster(cls, v: str | None) -> str | None:
        if v is None:
            return None
        if not re.fullmatch(r"[a-z][a-z0-9_-]{0,39}", v):
            raise InvalidInput(
                f"wlm_cluster: {v[:40]!r} is not a cluster name (a lower-case letter, then a-z, 0-9, _ or -; up to 40)",
                field="wlm_cluster",
            )
        return v

    @field_validator("bmc_user")
    @classmethod
    def _bmc_user(cls, v: str | None) -> str | None:
        return None if v is None else check_bmc_user(v)


class Category(CategoryBase, table=True):
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True, max_length=63)
    health_policy: dict[str, Any] | None = Field(default=None, sa_column=json_column())
    created_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))
    bmc_password_enc: str | None = Field(default=None, sa_column=Column(Text))  # Fernet, see services.secrets
    # member node -> the BMC (bcm.domain.power.target_key) it had when an admin set the password above
    bmc_password_targets: dict[str, str] | None = Field(default=None, sa_column=json_column())
    bmc_allow_http: bool = False  # admin only: members may reach Redfish BMCs over plain http
    # admin only, set with the password: the password also goes to a BMC that a discovery reports inside
    # this network (a machine its rule registers), bound to that BMC from then on
    bmc_discover_range: str | None = Field(default=None, max_length=64)
    # install to disk (#30): the members' install mode and disk layout (bcm.domain.disk_layout), set through
    # PUT /categories/{name}/install only (a data node's wipe needs an admin's confirmation there)
    install_mode: str | None = Field(default=None, max_length=8)
    disk_layout: dict[str, Any] | None = Field(default=None, sa_column=json_column())


class CategoryInstallUpdate(SQLModel):
    """``PUT /categories/{name}/install``: unset fields keep their values; null clears one."""

    install_mode: str | None = Field(default=None, max_length=16)
    disk_layout: dict[str, Any] | None = None
    confirm_wipe: bool = False

    @field_validator("install_mode")
    @classmethod
    def _mode(cls, v: str | None) -> str | None:
        from bcm.domain.disk_layout import check_install_mode

        return check_install_mode(v)


class CategoryCreate(CategoryBase):
    name: str = Field(max_length=63)
    health_policy: HealthPolicy | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v)


class CategoryUpdate(CategoryBase):
    health_policy: HealthPolicy | None = None


class CategoryPublic(CategoryBase):
    name: str
    health_policy: dict[str, Any] | None = None
    node_count: int = 0
    bmc_allow_http: bool = False  # set by an admin only: PUT /categories/{name}/bmc-allow-http
    bmc_discover_range: str | None = None  # set by an admin only, with the password
    install_mode: str | None = None  # PUT /categories/{name}/install
    disk_layout: dict[str, Any] | None = None
    created_at: datetime
