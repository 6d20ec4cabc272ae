"""/api/v1/categories: the defaults nodes inherit."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, status

from bcm.api.deps import Operator, SessionDep, Viewer, actor
from bcm.api.params import Name
from bcm.errors import Forbidden
from bcm.models.auth import ApiToken, Role
from bcm.models.category import CategoryCreate, CategoryInstallUpdate, CategoryPublic, CategoryUpdate
from bcm.services import auth
from bcm.services import categories as svc

router = APIRouter(prefix="/categories", tags=["categories"])


@router.get("", response_model=list[CategoryPublic])
def list_categories(session: SessionDep, _t: Viewer) -> list[CategoryPublic]:
    return svc.list_public(session)


@router.post("", response_model=CategoryPublic, status_code=status.HTTP_201_CREATED)
def create_category(spec: CategoryCreate, session: SessionDep, token: Operator) -> CategoryPublic:
    _admin_only_fields(spec, token)
    return svc.to_public(svc.create(session, spec, actor(token)))


@router.get("/{name}", response_model=CategoryPublic)
def get_category(name: Name, session: SessionDep, _t: Viewer) -> CategoryPublic:
    return svc.get_public(session, name)


@router.patch("/{name}", response_model=CategoryPublic)
def update_category(name: Name, spec: CategoryUpdate, session: SessionDep, token: Operator) -> CategoryPublic:
    _admin_only_fields(spec, token)
    return svc.to_public(svc.update_category(session, name, spec, actor(token)))


@router.put("/{name}/install", response_model=CategoryPublic)
def set_install(
    name: Name, body: CategoryInstallUpdate, session: SessionDep, token: Operator
) -> CategoryPublic:
    """The members' install mode and disk layout (#30), checked against every member's inventoried disks
    (a 422 naming what does not fit); a data node that would be wiped needs an admin's confirm_wipe (409)."""
    from bcm.services import install

    cat = install.set_category(session, name, body, actor(token), auth.has_role(token, Role.ADMIN))
    return svc.get_public(session, cat.name)


@router.delete("/{name}")
def delete_category(name: Name, session: SessionDep, token: Operator) -> dict[str, Any]:
    svc.delete(session, name, actor(token))
    return {"deleted": name}


# where a node's SSH host key comes from decides what bcm trusts at boot: an admin's choice, as BMC http is
ADMIN_ONLY = ("host_key_source",)


def _admin_only_fields(spec: CategoryCreate | CategoryUpdate, token: ApiToken) -> None:
    for field in ADMIN_ONLY:
        if field in spec.model_fields_set:
            try:
                auth.require_role(token, Role.ADMIN)
            except Forbidden:
                raise Forbidden(f"{field}: only an admin may set it", field=field) from None
