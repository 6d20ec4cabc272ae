"""Tenancy use cases: departments, projects, their bindings; the quota invariants; who may act
(through the one table in ``bcm.domain.tenancy``); the tree a workload manager renders.

Services flush but never commit: the request owns the transaction. A department's row is locked
(``FOR UPDATE`` on PostgreSQL) while its projects' quotas are summed, so two concurrent requests
cannot both squeeze a project into the same room.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from sqlalchemy import func
from sqlmodel import Session, col, select

from bcm.domain import tenancy as rules
from bcm.domain.tenancy import Action, Scope
from bcm.drivers.wlm.base import AccountSpec, write_private
from bcm.errors import Conflict, Duplicate, Forbidden, InvalidInput, NotFound
from bcm.models.auth import ApiToken, Role, User
from bcm.models.base import utcnow
from bcm.models.tenancy import (
    Department,
    DepartmentAdmin,
    DepartmentCreate,
    DepartmentPublic,
    DepartmentUpdate,
    Project,
    ProjectCreate,
    ProjectMember,
    ProjectPublic,
    ProjectUpdate,
)

UNIX_NAME_MAX = 32  # members become Unix users on the cluster's nodes


# ---- lookups ------------------------------------------------------------------------------------------


def get_department(session: Session, name: str, *, lock: bool = False) -> Department:
    stmt = select(Department).where(Department.name == name)
    row = session.exec(stmt.with_for_update() if lock else stmt).first()
    if row is None:
        raise NotFound(f"department {name!r} not found (add one with `bcm dept add`)")
    return row


def get_project(session: Session, name: str) -> Project:
    row = session.exec(select(Project).where(Project.name == name)).first()
    if row is None:
        raise NotFound(f"project {name!r} not found (add one with `bcm project add`)")
    return row


def _user(session: Session, name: str) -> User:
    row = session.exec(select(User).where(User.name == name)).first()
    if row is None:
        raise NotFound(f"user {name!r} not found (add one with `bcm user add`)")
    return row


def _department_name(session: Session, department_id: int) -> str:
    row = session.get(Department, department_id)
    return row.name if row else "?"


# ---- authorization ----------------------------------------------------------------------------------


def scope_of(
    session: Session, token: ApiToken, department: Department | None, project: Project | None = None
) -> Scope:
    """The caller's strongest binding on the object: a project is also in its department's scope."""
    if token.user_id is None:
        return Scope.NONE
    dept_id = project.department_id if project is not None else (department.id if department else None)
    if dept_id is not None:
        admin = session.exec(
            select(DepartmentAdmin.id).where(
                DepartmentAdmin.department_id == dept_id, DepartmentAdmin.user_id == token.user_id
            )
        ).first()
        if admin is not None:
            return Scope.DEPARTMENT_ADMIN
    if project is not None:
        member = session.exec(
            select(ProjectMember.id).where(
                ProjectMember.project_id == project.id, ProjectMember.user_id == token.user_id
            )
        ).first()
        if member is not None:
            return Scope.PROJECT_MEMBER
    return Scope.NONE


def widest_scope(session: Session, token: ApiToken) -> Scope:
    """The strongest binding the caller holds anywhere (what they might be allowed on some object)."""
    if token.user_id is None:
        return Scope.NONE
    if session.exec(select(DepartmentAdmin.id).where(DepartmentAdmin.user_id == token.user_id)).first():
        return Scope.DEPARTMENT_ADMIN
    if session.exec(select(ProjectMember.id).where(ProjectMember.user_id == token.user_id)).first():
        return Scope.PROJECT_MEMBER
    return Scope.NONE


def precheck(session: Session, token: ApiToken, action: Action) -> None:
    """403 before the request body is read, for a caller no object could allow ``action``."""
    if not rules.allowed(Role(token.role), widest_scope(session, token), action):
        _refuse(token, action, "any department or project")


def may(
    session: Session,
    token: ApiToken,
    action: Action,
    department: Department | None,
    project: Project | None = None,
) -> bool:
    return rules.allowed(Role(token.role), scope_of(session, token, department, project), action)


def authorize(
    session: Session,
    token: ApiToken,
    action: Action,
    department: Department | None,
    project: Project | None = None,
) -> None:
    """403 naming the role, the action and what would allow it."""
    if may(session, token, action, department, project):
        return
    where = (
        f"project {project.name}"
        if project
        else (f"department {department.name}" if department else "tenancy")
    )
    _refuse(token, action, where)


def _refuse(token: ApiToken, action: Action, where: str) -> None:
    needs = [r.value for r in (Role.VIEWER, Role.OPERATOR, Role.ADMIN) if action in rules.SYSTEM[r]][:1]
    scoped = [s.value for s in (Scope.PROJECT_MEMBER, Scope.DEPARTMENT_ADMIN) if action in rules.SCOPED[s]]
    raise Forbidden(
        f"role {token.role} may not {action.value} on {where} (needs {' or '.join(needs + scoped) or 'admin'})"
    )


# ---- departments --------------------------------------------------------------------------------------


def _deserved(session: Session, department_id: int | None, *, excluding: int | None = None) -> dict[str, int]:
    stmt = select(Project.name, Project.deserved_gpus).where(Project.department_id == department_id)
    if excluding is not None:
        stmt = stmt.where(Project.id != excluding)
    return dict(session.exec(stmt).all())


def _names_taken(session: Session, name: str) -> None:
    """Departments and projects share one namespace (both are Slurm accounts)."""
    if session.exec(select(Department.id).where(Department.name == name)).first() is not None:
        raise Duplicate(f"name: {name!r} is already a department", field="name")
    if session.exec(select(Project.id).where(Project.name == name)).first() is not None:
        raise Duplicate(f"name: {name!r} is already a project", field="name")


def list_departments(session: Session, token: ApiToken) -> list[Department]:
    rows = session.exec(select(Department).order_by(col(Department.name))).all()
    return [d for d in rows if may(session, token, Action.READ, d)]


def create_department(session: Session, spec: DepartmentCreate) -> Department:
    _names_taken(session, spec.name)
    row = Department(**spec.model_dump())
    session.add(row)
    session.flush()
    return row


def update_department(session: Session, name: str, spec: DepartmentUpdate) -> Department:
    row = get_department(session, name, lock=True)
    changes = spec.model_dump(exclude_unset=True)
    if changes.get("gpu_quota") is not None:
        rules.check_quota(row.name, changes["gpu_quota"], _deserved(session, row.id))
    for key, value in changes.items():
        if value is not None or key == "description":
            setattr(row, key, value)
    row.updated_at = utcnow()
    session.add(row)
    session.flush()
    return row


def delete_department(session: Session, name: str) -> Department:
    row = get_department(session, name)
    projects = sorted(_deserved(session, row.id))
    if projects:
        raise Conflict(
            f"department {name} still has projects ({', '.join(projects)}); remove or move them first"
        )
    session.delete(row)
    session.flush()
    return row


def department_public(session: Session, row: Department) -> DepartmentPublic:
    deserved = _deserved(session, row.id)
    admins = session.exec(
        select(User.name)
        .join(DepartmentAdmin, col(DepartmentAdmin.user_id) == col(User.id))
        .where(DepartmentAdmin.department_id == row.id)
        .order_by(col(User.name))
    ).all()
    return DepartmentPublic(
        **row.model_dump(
            include={"name", "gpu_quota", "fairshare", "description", "created_at", "updated_at"}
        ),
        deserved_gpus=sum(deserved.values()),
        projects=sorted(deserved),
        admins=list(admins),
    )


def add_admin(session: Session, department: Department, user: str) -> None:
    person = _user(session, user)
    if session.exec(
        select(DepartmentAdmin.id).where(
            DepartmentAdmin.department_id == department.id, DepartmentAdmin.user_id == person.id
        )
    ).first():
        raise Duplicate(f"user: {user} is already an admin of department {department.name}")
    session.add(DepartmentAdmin(department_id=department.id or 0, user_id=person.id or 0))
    session.flush()


def remove_admin(session: Session, department: Department, user: str) -> None:
    person = _user(session, user)
    row = session.exec(
        select(DepartmentAdmin).where(
            DepartmentAdmin.department_id == department.id, DepartmentAdmin.user_id == person.id
        )
    ).first()
    if row is None:
        raise NotFound(f"user {user} is not an admin of department {department.name}")
    session.delete(row)
    session.flush()


# ---- projects -----------------------------------------------------------------------------------------


def list_projects(session: Session, token: ApiToken, department: str | None = None) -> list[Project]:
    stmt = select(Project).order_by(col(Project.name))
    if department is not None:
        stmt = stmt.where(Project.department_id == get_department(session, department).id)
    depts = {d.id: d for d in session.exec(select(Department))}
    return [p for p in session.exec(stmt) if may(session, token, Action.READ, depts.get(p.department_id), p)]


def create_project(session: Session, spec: ProjectCreate) -> Project:
    _names_taken(session, spec.name)
    dept = get_department(session, spec.department, lock=True)
    limit = spec.deserved_gpus if spec.limit_gpus is None else spec.limit_gpus
    rules.check_limit(spec.deserved_gpus, limit)
    rules.check_fits(
        dept.name,
        dept.gpu_quota,
        _deserved(session, dept.id),
        spec.name,
        spec.deserved_gpus,
        field="deserved_gpus",
    )
    row = Project(
        name=spec.name,
        department_id=dept.id or 0,
        deserved_gpus=spec.deserved_gpus,
        limit_gpus=limit,
        fairshare=spec.fairshare,
        description=spec.description,
    )
    session.add(row)
    session.flush()
    return row


def update_project(session: Session, row: Project, spec: ProjectUpdate, target: Department | None) -> Project:
    """Change a project; ``target`` is the department it moves to (already authorized), if any."""
    changes = spec.model_dump(exclude_unset=True)
    deserved = changes.get("deserved_gpus")
    deserved = row.deserved_gpus if deserved is None else deserved
    limit = changes.get("limit_gpus")
    limit = row.limit_gpus if limit is None else limit
    rules.check_limit(deserved, limit)
    dept = target or get_department(session, _department_name(session, row.department_id), lock=True)
    if target is not None:
        get_department(session, target.name, lock=True)
    field = "department" if target is not None and target.id != row.department_id else "deserved_gpus"
    rules.check_fits(
        dept.name,
        dept.gpu_quota,
        _deserved(session, dept.id, excluding=row.id),
        row.name,
        deserved,
        field=field,
    )
    row.department_id = dept.id or 0
    row.deserved_gpus, row.limit_gpus = deserved, limit
    if changes.get("fairshare") is not None:
        row.fairshare = changes["fairshare"]
    if "description" in changes:
        row.description = changes["description"]
    row.updated_at = utcnow()
    session.add(row)
    session.flush()
    return row


def delete_project(session: Session, row: Project) -> None:
    session.delete(row)
    session.flush()


def members(session: Session, project: Project) -> list[str]:
    return list(
        session.exec(
            select(User.name)
            .join(ProjectMember, col(ProjectMember.user_id) == col(User.id))
            .where(ProjectMember.project_id == project.id)
            .order_by(col(User.name))
        ).all()
    )


def add_member(session: Session, project: Project, user: str) -> None:
    if len(user) > UNIX_NAME_MAX:
        raise InvalidInput(
            f"user: {user!r} is longer than {UNIX_NAME_MAX} characters and cannot be a Unix user on the"
            " cluster's nodes",
            field="user",
        )
    person = _user(session, user)
    if session.exec(
        select(ProjectMember.id).where(
            ProjectMember.project_id == project.id, ProjectMember.user_id == person.id
        )
    ).first():
        raise Duplicate(f"user: {user} is already a member of project {project.name}")
    session.add(ProjectMember(project_id=project.id or 0, user_id=person.id or 0))
    session.flush()


def remove_member(session: Session, project: Project, user: str) -> None:
    person = _user(session, user)
    row = session.exec(
        select(ProjectMember).where(
            ProjectMember.project_id == project.id, ProjectMember.user_id == person.id
        )
    ).first()
    if row is None:
        raise NotFound(f"user {user} is not a member of project {project.name}")
    session.delete(row)
    session.flush()


def project_public(session: Session, row: Project) -> ProjectPublic:
    return ProjectPublic(
        **row.model_dump(
            include={
                "name",
                "deserved_gpus",
                "limit_gpus",
                "fairshare",
                "description",
                "created_at",
                "updated_at",
            }
        ),
        department=_department_name(session, row.department_id),
        members=members(session, row),
    )


# ---- what a workload manager renders ---------------------------------------------------------------------


def has_accounts(session: Session) -> bool:
    """Whether any department exists (then Slurm enforces associations and limits)."""
    return (session.exec(select(func.count()).select_from(Department)).one() or 0) > 0


def accounts(session: Session) -> list[AccountSpec]:
    """The whole tree, departments first, each list in name order; members sorted."""
    depts = list(session.exec(select(Department).order_by(col(Department.name))))
    by_id = {d.id: d.name for d in depts}
    out = [AccountSpec(d.name, None, d.fairshare, None, (), d.gpu_quota) for d in depts]
    people: dict[int, list[str]] = {}
    for project_id, name in session.exec(
        select(ProjectMember.project_id, User.name).join(User, col(User.id) == col(ProjectMember.user_id))
    ):
        people.setdefault(project_id, []).append(name)
    for p in session.exec(select(Project).order_by(col(Project.name))):
        out.append(
            AccountSpec(
                p.name,
                by_id[p.department_id],
                p.fairshare,
                p.limit_gpus,
                tuple(sorted(people.get(p.id or 0, []))),
                p.deserved_gpus,
            )
        )
    return out


UID_BASE = 20000  # a member's Unix uid is UID_BASE + their bcm user id, the same on every node


def unix_ids(session: Session, names: list[str]) -> dict[str, int]:
    if not names:
        return {}
    rows = session.exec(select(User.name, User.id).where(col(User.name).in_(names))).all()
    return {name: UID_BASE + (uid or 0) for name, uid in rows}


def _previous_file(state_dir: Path, cluster: str) -> Path:
    return state_dir / "wlm" / cluster / "tenancy.json"


def previous(state_dir: Path, cluster: str) -> list[AccountSpec]:
    """What bcm last applied to the cluster (drift is measured against it); [] before the first apply."""
    path = _previous_file(state_dir, cluster)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [
        AccountSpec(
            a["name"], a["parent"], a["fairshare"], a["gpu_limit"], tuple(a["users"]), a.get("gpu_deserved")
        )
        for a in data
    ]


def remember(state_dir: Path, cluster: str, applied: list[AccountSpec]) -> None:
    data = [dict(asdict(a), users=list(a.users)) for a in applied]
    write_private(_previous_file(state_dir, cluster), json.dumps(data, indent=1).encode())
