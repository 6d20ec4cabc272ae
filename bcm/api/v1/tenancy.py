"""/api/v1/departments, /api/v1/projects, /api/v1/tenancy: the tenancy model, its bindings, and its
rendering into the workload manager (plan, apply). Every route asks ``bcm.services.tenancy.authorize``
(the one role × scope × action table) before it reads or changes anything."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, status

from bcm.api.deps import Caller, SessionDep, actor
from bcm.api.params import Name, NameQuery, text_query
from bcm.domain.tenancy import Action
from bcm.models.auth import ApiToken
from bcm.models.tenancy import (
    DepartmentCreate,
    DepartmentPublic,
    DepartmentUpdate,
    ProjectCreate,
    ProjectPublic,
    ProjectUpdate,
    UserRef,
)
from bcm.services import events
from bcm.services import tenancy as svc
from bcm.workers import tenancy as jobs


def can(action: Action) -> Callable[..., ApiToken]:
    """A dependency: 403 (before the body is read) for a caller whom no object could allow ``action``."""

    def _check(token: Caller, session: SessionDep) -> ApiToken:
        svc.precheck(session, token, action)
        return token

    return _check


Reader = Annotated[ApiToken, Depends(can(Action.READ))]


departments = APIRouter(prefix="/departments", tags=["tenancy"])
projects = APIRouter(prefix="/projects", tags=["tenancy"])
router = APIRouter(prefix="/tenancy", tags=["tenancy"])


# ---- departments ----------------------------------------------------------------------------------------


@departments.get("", response_model=list[DepartmentPublic])
def list_departments(session: SessionDep, token: Caller) -> list[DepartmentPublic]:
    return [svc.department_public(session, d) for d in svc.list_departments(session, token)]


@departments.post("", response_model=DepartmentPublic, status_code=status.HTTP_201_CREATED)
def create_department(
    spec: DepartmentCreate,
    session: SessionDep,
    token: Annotated[ApiToken, Depends(can(Action.CREATE_DEPARTMENT))],
) -> DepartmentPublic:
    svc.authorize(session, token, Action.CREATE_DEPARTMENT, None)
    row = svc.create_department(session, spec)
    events.record(session, actor(token), "department.create", row.name, f"{row.gpu_quota} GPUs")
    return svc.department_public(session, row)


@departments.get("/{name}", response_model=DepartmentPublic)
def get_department(name: Name, session: SessionDep, token: Caller) -> DepartmentPublic:
    row = svc.get_department(session, name)
    svc.authorize(session, token, Action.READ, row)
    return svc.department_public(session, row)


@departments.patch("/{name}", response_model=DepartmentPublic)
def update_department(
    name: Name,
    spec: DepartmentUpdate,
    session: SessionDep,
    token: Annotated[ApiToken, Depends(can(Action.UPDATE_DEPARTMENT))],
) -> DepartmentPublic:
    svc.authorize(session, token, Action.UPDATE_DEPARTMENT, svc.get_department(session, name))
    row = svc.update_department(session, name, spec)
    events.record(session, actor(token), "department.update", row.name, f"{row.gpu_quota} GPUs")
    return svc.department_public(session, row)


@departments.delete("/{name}")
def delete_department(
    name: Name, session: SessionDep, token: Annotated[ApiToken, Depends(can(Action.DELETE_DEPARTMENT))]
) -> dict[str, str]:
    svc.authorize(session, token, Action.DELETE_DEPARTMENT, svc.get_department(session, name))
    svc.delete_department(session, name)
    events.record(session, actor(token), "department.delete", name)
    return {"deleted": name}


@departments.post("/{name}/admins", response_model=DepartmentPublic, status_code=status.HTTP_201_CREATED)
def add_admin(
    name: Name,
    body: UserRef,
    session: SessionDep,
    token: Annotated[ApiToken, Depends(can(Action.MANAGE_ADMINS))],
) -> DepartmentPublic:
    row = svc.get_department(session, name)
    svc.authorize(session, token, Action.MANAGE_ADMINS, row)
    svc.add_admin(session, row, body.user)
    events.record(session, actor(token), "department.admin_add", name, body.user)
    return svc.department_public(session, row)


@departments.delete("/{name}/admins/{user}", response_model=DepartmentPublic)
def remove_admin(
    name: Name,
    user: Name,
    session: SessionDep,
    token: Annotated[ApiToken, Depends(can(Action.MANAGE_ADMINS))],
) -> DepartmentPublic:
    row = svc.get_department(session, name)
    svc.authorize(session, token, Action.MANAGE_ADMINS, row)
    svc.remove_admin(session, row, user)
    events.record(session, actor(token), "department.admin_remove", name, user)
    return svc.department_public(session, row)


# ---- projects -------------------------------------------------------------------------------------------


@projects.get("", response_model=list[ProjectPublic])
def list_projects(session: SessionDep, token: Caller, department: NameQuery = None) -> list[ProjectPublic]:
    return [svc.project_public(session, p) for p in svc.list_projects(session, token, department)]


@projects.post("", response_model=ProjectPublic, status_code=status.HTTP_201_CREATED)
def create_project(
    spec: ProjectCreate, session: SessionDep, token: Annotated[ApiToken, Depends(can(Action.CREATE_PROJECT))]
) -> ProjectPublic:
    svc.authorize(session, token, Action.CREATE_PROJECT, svc.get_department(session, spec.department))
    row = svc.create_project(session, spec)
    events.record(
        session, actor(token), "project.create", row.name, f"{row.deserved_gpus}/{row.limit_gpus} GPUs"
    )
    return svc.project_public(session, row)


def _project(session: SessionDep, token: Caller, name: str, action: Action) -> Any:
    row = svc.get_project(session, name)
    svc.authorize(session, token, action, None, row)
    return row


@projects.get("/{name}", response_model=ProjectPublic)
def get_project(name: Name, session: SessionDep, token: Caller) -> ProjectPublic:
    return svc.project_public(session, _project(session, token, name, Action.READ))


@projects.patch("/{name}", response_model=ProjectPublic)
def update_project(
    name: Name,
    spec: ProjectUpdate,
    session: SessionDep,
    token: Annotated[ApiToken, Depends(can(Action.UPDATE_PROJECT))],
) -> ProjectPublic:
    row = _project(session, token, name, Action.UPDATE_PROJECT)
    target = None
    if spec.department is not None:
        target = svc.get_department(session, spec.department)
        svc.authorize(session, token, Action.CREATE_PROJECT, target)  # moving in = making one there
    row = svc.update_project(session, row, spec, target)
    events.record(
        session, actor(token), "project.update", row.name, f"{row.deserved_gpus}/{row.limit_gpus} GPUs"
    )
    return svc.project_public(session, row)


@projects.delete("/{name}")
def delete_project(
    name: Name, session: SessionDep, token: Annotated[ApiToken, Depends(can(Action.DELETE_PROJECT))]
) -> dict[str, str]:
    svc.delete_project(session, _project(session, token, name, Action.DELETE_PROJECT))
    events.record(session, actor(token), "project.delete", name)
    return {"deleted": name}


@projects.get("/{name}/members", response_model=list[str])
def list_members(name: Name, session: SessionDep, token: Caller) -> list[str]:
    return svc.members(session, _project(session, token, name, Action.READ))


@projects.post("/{name}/members", response_model=ProjectPublic, status_code=status.HTTP_201_CREATED)
def add_member(
    name: Name,
    body: UserRef,
    session: SessionDep,
    token: Annotated[ApiToken, Depends(can(Action.MANAGE_MEMBERS))],
) -> ProjectPublic:
    row = _project(session, token, name, Action.MANAGE_MEMBERS)
    svc.add_member(session, row, body.user)
    events.record(session, actor(token), "project.member_add", name, body.user)
    return svc.project_public(session, row)


@projects.delete("/{name}/members/{user}", response_model=ProjectPublic)
def remove_member(
    name: Name,
    user: Name,
    session: SessionDep,
    token: Annotated[ApiToken, Depends(can(Action.MANAGE_MEMBERS))],
) -> ProjectPublic:
    row = _project(session, token, name, Action.MANAGE_MEMBERS)
    svc.remove_member(session, row, user)
    events.record(session, actor(token), "project.member_remove", name, user)
    return svc.project_public(session, row)


@projects.get("/{name}/usage")
async def usage(
    name: Name,
    request: Request,
    session: SessionDep,
    token: Annotated[ApiToken, Depends(can(Action.READ_USAGE))],
) -> dict[str, Any]:
    row = _project(session, token, name, Action.READ_USAGE)
    body = {
        "project": row.name,
        "department": svc.project_public(session, row).department,
        "deserved_gpus": row.deserved_gpus,
        "limit_gpus": row.limit_gpus,
        "fairshare": row.fairshare,
    }
    session.commit()  # the connection goes back before the workload manager is asked
    app = request.app
    body["wlm"] = await jobs.usage(app.state.engine, app.state.settings, row.name)
    return body


# ---- rendering into the workload manager -----------------------------------------------------------------


@router.get("/plan")
async def plan(
    request: Request,
    session: SessionDep,
    token: Annotated[ApiToken, Depends(can(Action.PLAN))],
    cluster: Annotated[str | None, text_query(40, "the cluster (default: the only one)")] = None,
) -> dict[str, Any]:
    svc.authorize(session, token, Action.PLAN, None)
    session.commit()
    return await jobs.plan(request.app.state.engine, request.app.state.settings, cluster)


@router.post("/apply")
async def apply(
    request: Request,
    session: SessionDep,
    token: Annotated[ApiToken, Depends(can(Action.APPLY))],
    cluster: Annotated[str | None, text_query(40, "the cluster (default: the only one)")] = None,
) -> dict[str, Any]:
    """Start a ``tenancy.apply`` operation: ``{"cluster", "operation_id"}``; its plan is the operation's
    ``outcome`` once it ends (``bcm tenancy apply`` follows it)."""
    svc.authorize(session, token, Action.APPLY, None)
    session.commit()
    return await jobs.start_apply(request.app.state.runner, cluster, actor(token))
