"""Tenancy: departments, their projects, project members and department admins (the scoped role
bindings), with the API schema family. Quota invariants are checked in ``bcm.services.tenancy``
(the arithmetic is ``bcm.domain.tenancy``); here every integer is bounded by its column.

Department and project names share one namespace: both become Slurm accounts, whose names are
unique across a cluster's whole tree.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import ConfigDict, field_validator
from sqlalchemy import UniqueConstraint
from sqlmodel import Field, SQLModel

from bcm.domain.bounds import INT32_MAX
from bcm.domain.naming import check_name
from bcm.models.base import ts_column, utcnow

NAME_MAX = 40  # Slurm account names: bcm keeps them short enough for every sacctmgr column
# Slurm's own account at the top of every tree; the namespaces Kubernetes, Kueue and bcm keep for themselves
RESERVED = frozenset(
    {"root", "default", "kube-system", "kube-public", "kube-node-lease", "kueue-system", "bcm-system"}
)


def check_account_name(value: str, field: str = "name") -> str:
    check_name(value, field)
    if len(value) > NAME_MAX:
        from bcm.errors import InvalidInput

        raise InvalidInput(f"{field}: {value!r} is longer than {NAME_MAX} characters", field=field)
    if value in RESERVED:
        from bcm.errors import InvalidInput

        raise InvalidInput(f"{field}: {value!r} is reserved (Slurm or Kubernetes uses it)", field=field)
    return value


class Department(SQLModel, table=True):
    """A share of the cluster's GPUs; its projects' deserved GPUs never add up to more than ``gpu_quota``."""

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=NAME_MAX, unique=True, index=True)
    gpu_quota: int = Field(ge=0, le=INT32_MAX)
    fairshare: int = Field(default=1, ge=1, le=INT32_MAX)
    description: str | None = Field(default=None, max_length=200)
    created_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))
    updated_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))


class Project(SQLModel, table=True):
    """Deserved GPUs (guaranteed), a limit it may reach when others leave GPUs idle, a fair-share weight."""

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=NAME_MAX, unique=True, index=True)
    department_id: int = Field(foreign_key="department.id", index=True, ondelete="RESTRICT")
    deserved_gpus: int = Field(ge=0, le=INT32_MAX)
    limit_gpus: int = Field(ge=0, le=INT32_MAX)
    fairshare: int = Field(default=1, ge=1, le=INT32_MAX)
    description: str | None = Field(default=None, max_length=200)
    created_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))
    updated_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))


class ProjectMember(SQLModel, table=True):
    """A user bound to a project (the project-member role): they submit as its account, read its usage."""

    __tablename__ = "project_member"
    __table_args__ = (UniqueConstraint("project_id", "user_id"),)

    id: int | None = Field(default=None, primary_key=True)
    project_id: int = Field(foreign_key="project.id", index=True, ondelete="CASCADE")
    user_id: int = Field(foreign_key="users.id", index=True, ondelete="CASCADE")
    created_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))


class DepartmentAdmin(SQLModel, table=True):
    """A user bound to a department (the department-admin role): manages only its projects."""

    __tablename__ = "department_admin"
    __table_args__ = (UniqueConstraint("department_id", "user_id"),)

    id: int | None = Field(default=None, primary_key=True)
    department_id: int = Field(foreign_key="department.id", index=True, ondelete="CASCADE")
    user_id: int = Field(foreign_key="users.id", index=True, ondelete="CASCADE")
    created_at: datetime = Field(default_factory=utcnow, sa_column=ts_column(nullable=False))


# ---- API schemas -----------------------------------------------------------------------------------


class DepartmentCreate(SQLModel):
    model_config = ConfigDict(strict=True)  # type: ignore[assignment]  # true is not 1: counts are integers

    name: str = Field(max_length=NAME_MAX)
    gpu_quota: int = Field(ge=0, le=INT32_MAX)
    fairshare: int = Field(default=1, ge=1, le=INT32_MAX)
    description: str | None = Field(default=None, max_length=200)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_account_name(v)


class DepartmentUpdate(SQLModel):
    model_config = ConfigDict(strict=True)  # type: ignore[assignment]  # true is not 1: counts are integers

    gpu_quota: int | None = Field(default=None, ge=0, le=INT32_MAX)
    fairshare: int | None = Field(default=None, ge=1, le=INT32_MAX)
    description: str | None = Field(default=None, max_length=200)


class DepartmentPublic(SQLModel):
    name: str
    gpu_quota: int
    fairshare: int
    description: str | None
    deserved_gpus: int  # what its projects deserve, together
    projects: list[str]
    admins: list[str]
    created_at: datetime
    updated_at: datetime


class ProjectCreate(SQLModel):
    model_config = ConfigDict(strict=True)  # type: ignore[assignment]  # true is not 1: counts are integers

    name: str = Field(max_length=NAME_MAX)
    department: str = Field(max_length=NAME_MAX)
    deserved_gpus: int = Field(ge=0, le=INT32_MAX)
    limit_gpus: int | None = Field(default=None, ge=0, le=INT32_MAX, description="default: deserved_gpus")
    fairshare: int = Field(default=1, ge=1, le=INT32_MAX)
    description: str | None = Field(default=None, max_length=200)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_account_name(v)

    @field_validator("department")
    @classmethod
    def _department(cls, v: str) -> str:
        return check_account_name(v, "department")


class ProjectUpdate(SQLModel):
    model_config = ConfigDict(strict=True)  # type: ignore[assignment]  # true is not 1: counts are integers

    department: str | None = Field(default=None, max_length=NAME_MAX)
    deserved_gpus: int | None = Field(default=None, ge=0, le=INT32_MAX)
    limit_gpus: int | None = Field(default=None, ge=0, le=INT32_MAX)
    fairshare: int | None = Field(default=None, ge=1, le=INT32_MAX)
    description: str | None = Field(default=None, max_length=200)

    @field_validator("department")
    @classmethod
    def _department(cls, v: str | None) -> str | None:
        return None if v is None else check_account_name(v, "department")


class ProjectPublic(SQLModel):
    name: str
    department: str
    deserved_gpus: int
    limit_gpus: int
    fairshare: int
    description: str | None
    members: list[str]
    created_at: datetime
    updated_at: datetime


class UserRef(SQLModel):
    """A bcm user named in a binding (member of a project, admin of a department)."""

    user: str = Field(max_length=63)

    @field_validator("user")
    @classmethod
    def _user(cls, v: str) -> str:
        return check_name(v, "user")
