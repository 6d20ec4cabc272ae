"""Tenancy rules without I/O: who may do what (role × scope × action) and the quota arithmetic.

Authorization is decided here and only here: :func:`allowed` is one table. The caller's *role* is
its token's system role (admin, operator, viewer, user); its *scope* is its strongest binding on the
object acted on (admin of the department, member of the project, or none). A system role keeps its
meaning everywhere; a binding adds rights only on its own department or project.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

from bcm.errors import InvalidInput
from bcm.models.auth import Role


class Scope(StrEnum):
    NONE = "none"
    """No binding on the object."""
    PROJECT_MEMBER = "project-member"
    """A member of the project acted on."""
    DEPARTMENT_ADMIN = "department-admin"
    """An admin of the department acted on, or of the project's department."""


class Action(StrEnum):
    READ = "read"
    """See a department or project (its quotas, members, admins)."""
    CREATE_DEPARTMENT = "create-department"
    UPDATE_DEPARTMENT = "update-department"
    """Change a department's quota or fair-share weight."""
    DELETE_DEPARTMENT = "delete-department"
    MANAGE_ADMINS = "manage-admins"
    """Bind or unbind a department's admins."""
    CREATE_PROJECT = "create-project"
    UPDATE_PROJECT = "update-project"
    DELETE_PROJECT = "delete-project"
    MANAGE_MEMBERS = "manage-members"
    READ_USAGE = "read-usage"
    """A project's usage as the workload manager reports it."""
    PLAN = "plan"
    """See what the workload manager would be told (the whole cluster's tree)."""
    APPLY = "apply"
    """Tell the workload manager (the whole cluster's tree)."""


_READS = frozenset({Action.READ, Action.READ_USAGE, Action.PLAN})
_OPERATES = _READS | {
    Action.CREATE_DEPARTMENT,
    Action.UPDATE_DEPARTMENT,
    Action.CREATE_PROJECT,
    Action.UPDATE_PROJECT,
    Action.MANAGE_MEMBERS,
    Action.APPLY,
}
SYSTEM: Mapping[Role, frozenset[Action]] = {
    Role.ADMIN: frozenset(Action),
    Role.OPERATOR: frozenset(_OPERATES),
    Role.VIEWER: _READS,
    Role.USER: frozenset(),
    Role.NODE: frozenset(),
}
"""What a system role may do on any department or project."""

SCOPED: Mapping[Scope, frozenset[Action]] = {
    Scope.NONE: frozenset(),
    Scope.PROJECT_MEMBER: frozenset({Action.READ_USAGE}),
    Scope.DEPARTMENT_ADMIN: frozenset(
        {
            Action.READ,
            Action.READ_USAGE,
            Action.CREATE_PROJECT,
            Action.UPDATE_PROJECT,
            Action.DELETE_PROJECT,
            Action.MANAGE_MEMBERS,
        }
    ),
}
"""What a binding adds, on its own department (and that department's projects) or project only."""


def allowed(role: Role, scope: Scope, action: Action) -> bool:
    """Whether a caller of ``role`` with ``scope`` on the object may do ``action`` to it."""
    if role is Role.NODE:
        return False  # node tokens report for their node and nothing else, whatever else is bound
    return action in SYSTEM[role] or action in SCOPED[scope]


# ---- quota arithmetic -------------------------------------------------------------------------------


def check_limit(deserved: int, limit: int) -> None:
    """422 when the over-quota limit is below the deserved quota."""
    if limit < deserved:
        raise InvalidInput(
            f"limit_gpus: {limit} is below deserved_gpus {deserved} (the limit is what a project may"
            " reach when others leave GPUs idle, so at least what it deserves)",
            field="limit_gpus",
        )


def check_fits(
    department: str, quota: int, others: Mapping[str, int], name: str, deserved: int, *, field: str
) -> None:
    """422 when ``deserved`` for project ``name`` on top of the ``others`` would exceed the quota."""
    taken = sum(others.values())
    if taken + deserved > quota:
        listed = ", ".join(f"{p} {n}" for p, n in sorted(others.items())) or "none"
        raise InvalidInput(
            f"{field}: department {department} holds {quota} GPUs; its other projects deserve {taken}"
            f" ({listed}), so {deserved} more for {name} would make {taken + deserved}",
            field=field,
        )


def check_quota(department: str, quota: int, projects: Mapping[str, int]) -> None:
    """422 when a department's new quota is below what its projects deserve together."""
    total = sum(projects.values())
    if total > quota:
        listed = ", ".join(f"{p} {n}" for p, n in sorted(projects.items()))
        raise InvalidInput(
            f"gpu_quota: {quota} for department {department} is below the {total} GPUs its projects"
            f" deserve ({listed})",
            field="gpu_quota",
        )
