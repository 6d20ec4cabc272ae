"""/api/v1/images: recipes, builds (operations), versions, rollback, removal, push to nodes."""

from __future__ import annotations

from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Query, Request, status
from pydantic import BaseModel, ConfigDict, Field

from bcm.api.deps import Admin, Operator, SessionDep, Viewer, actor
from bcm.api.params import Name
from bcm.domain import image_recipe
from bcm.domain.naming import expand_hostlist
from bcm.models.image import ImageBuildRequest, ImageBuildStarted, ImageDetail, ImagePublic
from bcm.services import images as svc
from bcm.workers import image_push as push_worker
from bcm.workers import images as worker

router = APIRouter(prefix="/images", tags=["images"])
Version = Annotated[
    str | None, Query(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")
]


@router.get("", response_model=list[ImagePublic])
def list_images(session: SessionDep, _t: Viewer) -> list[ImagePublic]:
    """Every version of every image, oldest first per image."""
    return svc.listing(session)


@router.get("/recipes")
def list_recipes(request: Request, _t: Viewer) -> list[dict[str, Any]]:
    """The recipes bcm can build (``images/*.yaml``), each with its parent chain."""
    recipes = image_recipe.load_recipes(request.app.state.settings.images.recipes_dir)
    return [
        {
            "name": r.name,
            "parent": r.parent,
            "chain": [c.name for c in image_recipe.chain(recipes, r.name)],
            "description": r.description,
            "packages": len(r.packages),
        }
        for r in sorted(recipes.values(), key=lambda r: r.name)
    ]


@router.post("/build", response_model=ImageBuildStarted, status_code=status.HTTP_202_ACCEPTED)
async def build(body: ImageBuildRequest, request: Request, token: Operator) -> ImageBuildStarted:
    """Build a recipe into a new version (an operation); published and made current when verified."""
    name, version, op_id = await worker.start(
        request.app.state.runner, body.recipe, body.version, actor(token)
    )
    return ImageBuildStarted(name=name, version=version, operation_id=op_id)


@router.get("/{name}", response_model=ImageDetail)
def show(name: Name, session: SessionDep, _t: Viewer, version: Version = None) -> ImageDetail:
    """One version (default: the current one) with its artifacts and manifest summary."""
    return svc.to_detail(session, svc.get(session, name, version))


@router.get("/{name}/manifest")
def manifest(name: Name, session: SessionDep, _t: Viewer, version: Version = None) -> dict[str, Any]:
    """The full manifest of a version: every package with its version, kernel, driver, CUDA."""
    return svc.get(session, name, version).manifest or {}


@router.post("/{name}/rollback", response_model=ImagePublic)
def rollback(name: Name, session: SessionDep, token: Operator) -> ImagePublic:
    """Move the current version back to the ready version before it."""
    return svc.to_public(svc.rollback(session, name, actor(token)))


@router.delete("/{name}")
async def remove(
    name: Name, request: Request, session: SessionDep, token: Admin, version: Version = None
) -> dict[str, Any]:
    """Remove an image (or one version); refused while a node or category uses it."""
    images_dir = request.app.state.settings.images_dir
    removed = await anyio.to_thread.run_sync(svc.remove, session, name, version, images_dir, actor(token))
    return {"name": name, "removed": removed}


class ImagePushRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nodes: str = Field(min_length=1, max_length=65535, description="hostlist, e.g. gpu[01-16]")
    version: str | None = Field(
        default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"
    )
    apply: bool = False  # false: a dry run that changes nothing on the nodes


class ImagePushStarted(BaseModel):
    name: str
    version: str
    apply: bool
    nodes: int
    operation_id: int


@router.post("/{name}/push", response_model=ImagePushStarted, status_code=status.HTTP_202_ACCEPTED)
async def push(name: Name, body: ImagePushRequest, request: Request, token: Operator) -> ImagePushStarted:
    """Sync a version's tree onto running nodes with rsync (an operation); a dry run unless ``apply``."""
    names = expand_hostlist(body.nodes)
    version, op_id = await push_worker.start(
        request.app.state.runner, name, names, body.version, body.apply, actor(token)
    )
    return ImagePushStarted(
        name=name, version=version, apply=body.apply, nodes=len(names), operation_id=op_id
    )
