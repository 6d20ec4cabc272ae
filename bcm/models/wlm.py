"""Workload-manager clusters (Slurm now, Kubernetes later) and their members, with the API schema family.

Secrets (the munge key, the accounting database password) are not columns: they live in 0600 files
under ``<state_dir>/wlm/<name>/`` (see ``bcm.services.wlm``); the table keeps only a fingerprint.
Membership is a table (:class:`WlmMember`, one row per node, a node in at most one cluster); the API
still shows a cluster's compute members as one folded hostlist.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import SecretStr, field_validator
from sqlalchemy import Text, UniqueConstraint
from sqlmodel import Column, Field, SQLModel

from bcm.domain import kubernetes as k8s
from bcm.domain.bounds import INT32_MAX
from bcm.domain.naming import check_name
from bcm.domain.slurm import SlurmSettings, check_cluster_name
from bcm.models.base import json_column, ts_column, utcnow


class WlmKind(StrEnum):
    SLURM = "slurm"
    KUBERNETES = "kubernetes"


class WlmState(StrEnum):
    NEW = "new"
    """Recorded; never deployed."""
    DEPLOYING = "deploying"
    """A deploy operation runs."""
    DEPLOYED = "deployed"
    """The last deploy succeeded on the controller and every node."""
    PARTIAL = "partial"
    """The controller is up but some nodes failed to deploy."""
    FAILED = "failed"
    """The last deploy failed (see last_error)."""


class WlmRole(StrEnum):
    COMPUTE = "compute"
    """Runs jobs (the controller too, when it is named among the cluster's nodes)."""
    CONTROLLER = "controller"
    """Runs only the workload manager's control daemons (slurmctld, slurmdbd)."""


class WlmCluster(SQLModel, table=True):
    __tablename__ = "wlm_cluster"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=40, unique=True, index=True)
    kind: str = Field(default=WlmKind.SLURM, max_length=16)
    controller_id: int = Field(foreign_key="node.id", index=True)
    settings: dict[str, Any] | None = Field(default=None, sa_column=json_column())
    state: str = Field(default=WlmState.NEW, max_length=16)
    last_error: str | None = Field(default=None, sa_column=Column(Text))
    munge_key_sha256: str | None = Field(default=None, max_length=64)
    last_deploy_op: int | None = None
    last_verify_op: int | None = None
    last_verify_ok: bool | None = None
    last_verify_at: datetime | None = Field(default=None, sa_column=ts_column())
    last_verify: dict[str, Any] | None = Field(default=None, sa_column=json_column())
    synced_at: datetime | None = Field(default=None, sa_column=ts_column())
    usage_at: datetime | None = Field(default=None, sa_column=ts_column())  # when WlmUsage was last sampled
    created_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))
    updated_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))
    deployed_at: datetime | None = Field(default=None, sa_column=ts_column())


class WlmMember(SQLModel, table=True):
    """A node in a cluster, and its role there; deleting either side removes the row."""

    __tablename__ = "wlm_member"
    __table_args__ = (UniqueConstraint("node_id"),)  # a node is in at most one cluster

    id: int | None = Field(default=None, primary_key=True)
    cluster_id: int = Field(foreign_key="wlm_cluster.id", index=True, ondelete="CASCADE")
    node_id: int = Field(foreign_key="node.id", ondelete="CASCADE")
    role: str = Field(default=WlmRole.COMPUTE, max_length=16)


ACCOUNT_MAX = 64  # a Slurm account or Kubernetes namespace (63) as stored; longer ones are cut
TENANTS_PER_NODE = 8  # the accounts kept per node in a sample: those holding the most GPUs


class WlmUsage(SQLModel, table=True):
    """The last sample of who runs on a member node: one row per (node, account) with running work.

    Written by the workload-manager sync (``bcm.services.wlm_usage.apply``), replaced as a whole per
    cluster each time; a node leaving the cluster or the inventory takes its rows with it.
    """

    __tablename__ = "wlm_usage"
    __table_args__ = (UniqueConstraint("node_id", "account"),)

    id: int | None = Field(default=None, primary_key=True)
    cluster_id: int = Field(foreign_key="wlm_cluster.id", index=True, ondelete="CASCADE")
    node_id: int = Field(foreign_key="node.id", ondelete="CASCADE")
    account: str = Field(max_length=ACCOUNT_MAX, index=True)
    gpus: int = Field(default=0, ge=0, le=INT32_MAX)
    jobs: int = Field(default=0, ge=0, le=INT32_MAX)


class WlmDeployRequest(SQLModel):
    """What every deploy names: the cluster, its controller and member nodes; each kind adds its knobs."""

    name: str = Field(max_length=40)
    controller: str = Field(max_length=63)
    nodes: str = Field(max_length=65535)
    verify: bool = True

    def settings_json(self) -> dict[str, Any]:
        """The knobs as stored in the cluster's settings column."""
        return {}

    def secrets(self) -> dict[str, str]:
        """Write-only values the workload manager keeps in files (never in the database)."""
        return {}


class SlurmDeployRequest(WlmDeployRequest):
    """``bcm wlm deploy slurm``: controller node, member nodes, knobs; the DB password is write-only."""

    name: str = Field(default="slurm", max_length=40)
    settings: SlurmSettings = Field(default_factory=SlurmSettings)
    storage_pass: SecretStr | None = Field(default=None, max_length=256)

    def settings_json(self) -> dict[str, Any]:
        return self.settings.model_dump(mode="json")

    def secrets(self) -> dict[str, str]:
        return {"storage_pass": self.storage_pass.get_secret_value()} if self.storage_pass else {}

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_cluster_name(v)

    @field_validator("controller")
    @classmethod
    def _controller(cls, v: str) -> str:
        return check_name(v, "controller")

    @field_validator("storage_pass")
    @classmethod
    def _pass(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and any(c in v.get_secret_value() for c in "\n\r\0"):
            raise ValueError("storage_pass: must be one line")
        return v


class KubernetesDeployRequest(WlmDeployRequest):
    """``bcm wlm deploy kubernetes``: control-plane node (``controller``), member nodes, knobs."""

    name: str = Field(default="kubernetes", max_length=40)
    settings: k8s.KubernetesSettings = Field(default_factory=k8s.KubernetesSettings)

    def settings_json(self) -> dict[str, Any]:
        return self.settings.model_dump(mode="json")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return k8s.check_cluster_name(v)

    @field_validator("controller")
    @classmethod
    def _controller(cls, v: str) -> str:
        return check_name(v, "controller")


class WlmNodeRequest(SQLModel):
    nodes: str = Field(max_length=65535)
    reason: str | None = Field(default=None, max_length=200)


class WlmNodePublic(SQLModel):
    name: str
    wlm_state: str | None
    provision_state: str
    gpus: int


class WlmClusterPublic(SQLModel):
    name: str
    kind: str
    controller: str
    nodes: str
    state: str
    settings: dict[str, Any]
    last_error: str | None
    last_deploy_op: int | None
    last_verify_op: int | None
    last_verify_ok: bool | None
    last_verify_at: datetime | None
    last_verify: dict[str, Any] | None
    synced_at: datetime | None
    usage_at: datetime | None = None
    created_at: datetime
    updated_at: datetime
    deployed_at: datetime | None


class WlmClusterDetail(WlmClusterPublic):
    members: list[WlmNodePublic]


class WlmStarted(SQLModel):
    cluster: str
    operation_id: int
