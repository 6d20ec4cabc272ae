"""Image versions: start a build, publish it atomically, roll back, remove; the public views.

Publishing: a build fills ``<images>/.staging/<name>-<version>-<op>/``; after verification the directory
is renamed to ``<images>/<name>/<version>/`` (one rename on one filesystem) and, in the same
transaction, the row becomes ``ready`` with its artifacts and the image's *current* version moves to
it. A failed build leaves its row ``failed`` with the reason, the staging directory removed and the
previous current version untouched. Services flush, never commit: the request or job does.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from sqlalchemy import func
from sqlmodel import Session, col, select

from bcm.errors import Conflict, InvalidInput, NotFound
from bcm.models.base import utcnow
from bcm.models.category import Category
from bcm.models.image import (
    ArtifactPublic,
    Image,
    ImageArtifact,
    ImageDetail,
    ImagePublic,
    ImageState,
)
from bcm.models.node import Node
from bcm.services import events

VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
STAGING = ".staging"


def version_dir(images_dir: Path, name: str, version: str) -> Path:
    return images_dir / name / version


def staging_dir(images_dir: Path, name: str, version: str, op_id: int) -> Path:
    return images_dir / STAGING / f"{name}-{version}-{op_id}"


def _versions(session: Session, name: str) -> list[Image]:
    return list(session.exec(select(Image).where(Image.name == name).order_by(col(Image.id))))


def next_version(session: Session, name: str) -> str:
    """One more than the highest numeric version of this image so far ("1" for the first)."""
    numbers = [int(i.version) for i in _versions(session, name) if i.version.isdigit()]
    return str(max(numbers, default=0) + 1)


def begin_build(session: Session, name: str, version: str | None, actor: str) -> Image:
    """The row of a build about to start (``building``); a version already built is a 409."""
    if version is not None and not VERSION_RE.fullmatch(version):
        raise InvalidInput(
            f"version: {version[:64]!r} is not a version (letters, digits, . _ + -)", field="version"
        )
    version = version or next_version(session, name)
    if session.exec(select(Image).where(Image.name == name, Image.version == version)).first():
        raise Conflict(f"image {name} version {version} exists already; give another --version")
    image = Image(name=name, version=version, recipe=name, state=ImageState.BUILDING)
    session.add(image)
    events.record(session, actor, "image.build", f"{name}:{version}", "build started")
    session.flush()
    return image


def check_reference(session: Session, name: str | None, field: str = "image") -> None:
    """A node's or category's image must name an image with a ready version (None clears it)."""
    if name is None:
        return
    ready = session.exec(select(Image.id).where(Image.name == name, Image.state == ImageState.READY)).first()
    if ready is None:
        known = sorted(set(session.exec(select(Image.name).where(Image.state == ImageState.READY))))
        raise InvalidInput(
            f"{field}: no ready image named {name[:128]!r} (build it with `bcm image build`; ready: "
            f"{', '.join(known[:20]) or 'none'})",
            field=field,
        )


def get(session: Session, name: str, version: str | None = None) -> Image:
    """A version of an image: the given one, else the current one, else the newest."""
    rows = _versions(session, name)
    if not rows:
        raise NotFound(f"no image named {name!r}")
    if version is not None:
        for row in rows:
            if row.version == version:
                return row
        raise NotFound(
            f"image {name} has no version {version!r} (versions: {', '.join(r.version for r in rows)})"
        )
    current = [r for r in rows if r.is_current]
    return current[0] if current else rows[-1]


def artifacts(session: Session, image: Image) -> list[ImageArtifact]:
    return list(session.exec(select(ImageArtifact).where(ImageArtifact.image_id == image.id)))


def publish(
    session: Session,
    image: Image,
    staging: Path,
    images_dir: Path,
    found: list[Any],
    manifest: dict[str, Any],
    keep: int,
) -> Path:
    """Move a verified staging directory into place and make it current, in one transaction."""
    final = version_dir(images_dir, image.name, image.version)
    if final.exists():  # a leftover of an interrupted publish of this very row
        shutil.rmtree(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    os.rename(staging, final)
    assert image.id is not None
    for a in found:
        session.add(
            ImageArtifact(image_id=image.id, kind=a.kind, filename=a.filename, size=a.size, sha256=a.sha256)
        )
    image.state = ImageState.READY
    image.published_at = utcnow()
    image.manifest = manifest
    image.kernel_version = _short(manifest.get("kernel_version"))
    image.driver_version = _short(manifest.get("driver_version"))
    image.cuda_version = _short(manifest.get("cuda_version"))
    keys = manifest.get("layer_keys") or []
    image.layer_key = keys[-1][:64] if keys else None
    _make_current(session, image)
    events.record(
        session, "bcm:images", "image.publish", f"{image.name}:{image.version}", "published, current"
    )
    session.flush()
    prune(session, image.name, images_dir, keep)
    return final


def _short(value: object) -> str | None:
    return None if value is None else str(value)[:64]


def _make_current(session: Session, image: Image) -> None:
    for other in _versions(session, image.name):
        if other.is_current and other.id != image.id:
            other.is_current = False
            session.add(other)
    image.is_current = True
    session.add(image)


def fail(session: Session, image: Image, error: str, staging: Path | None) -> None:
    """A build that did not make it: the row says why; nothing of it stays on disk."""
    if staging is not None and staging.exists():
        shutil.rmtree(staging, ignore_errors=True)
    image.state = ImageState.FAILED
    image.error = error[-4000:]
    session.add(image)
    events.record(
        session, "bcm:images", "image.build", f"{image.name}:{image.version}", error[-500:], severity="error"
    )


def rollback(session: Session, name: str, actor: str) -> Image:
    """Make the ready version before the current one current again."""
    rows = [r for r in _versions(session, name) if r.state == ImageState.READY]
    if not rows:
        raise NotFound(f"image {name!r} has no ready version")
    idx = next((i for i, r in enumerate(rows) if r.is_current), len(rows))
    if idx == 0:
        raise Conflict(
            f"image {name} version {rows[0].version} is the oldest ready version; nothing to roll back to"
        )
    target = rows[idx - 1]
    _make_current(session, target)
    events.record(session, actor, "image.rollback", f"{name}:{target.version}", "current version moved back")
    session.flush()
    return target


def users(session: Session, name: str) -> tuple[int, int]:
    """How many nodes and categories name this image."""
    nodes = session.exec(select(func.count()).select_from(Node).where(Node.image == name)).one()
    cats = session.exec(select(func.count()).select_from(Category).where(Category.image == name)).one()
    return int(nodes), int(cats)


def remove(session: Session, name: str, version: str | None, images_dir: Path, actor: str) -> list[str]:
    """Remove an image (every version) or one version; refused while nodes or categories use it."""
    rows = _versions(session, name)
    if not rows:
        raise NotFound(f"no image named {name!r}")
    if version is not None:
        rows = [get(session, name, version)]
        if rows[0].is_current and len(_versions(session, name)) > 1:
            raise Conflict(f"image {name} version {version} is current; roll back first or remove the image")
    if version is None or len(_versions(session, name)) == 1:
        nodes, cats = users(session, name)
        if nodes or cats:
            raise Conflict(
                f"image {name} is used by {nodes} node(s) and {cats} categorie(s); assign another first"
            )
    for row in rows:
        if row.state == ImageState.BUILDING:
            raise Conflict(
                f"image {name} version {row.version} is still building (operation {row.operation_id})"
            )
    removed = []
    for row in rows:
        for a in artifacts(session, row):
            session.delete(a)
        session.delete(row)
        shutil.rmtree(version_dir(images_dir, name, row.version), ignore_errors=True)
        removed.append(row.version)
    events.record(session, actor, "image.remove", name, "removed versions " + ", ".join(removed))
    session.flush()
    return removed


def prune(session: Session, name: str, images_dir: Path, keep: int) -> list[str]:
    """Remove ready versions beyond the newest ``keep`` (the current one is always kept)."""
    ready = [r for r in _versions(session, name) if r.state == ImageState.READY]
    old = [r for r in ready[: max(0, len(ready) - keep)] if not r.is_current]
    for row in old:
        for a in artifacts(session, row):
            session.delete(a)
        session.delete(row)
        shutil.rmtree(version_dir(images_dir, name, row.version), ignore_errors=True)
    return [r.version for r in old]


# ---- views -----------------------------------------------------------------------------------------------


def to_public(image: Image) -> ImagePublic:
    return ImagePublic(
        name=image.name,
        version=image.version,
        state=image.state,
        current=image.is_current,
        recipe=image.recipe,
        kernel_version=image.kernel_version,
        driver_version=image.driver_version,
        cuda_version=image.cuda_version,
        layer_key=image.layer_key,
        operation_id=image.operation_id,
        error=image.error,
        created_at=image.created_at,
        published_at=image.published_at,
    )


def artifact_problem(images_dir: Path, image: Image, a: ImageArtifact) -> tuple[Path, str | None]:
    """The artifact's file, and what is wrong with it: ``missing`` or ``size`` (not what was published)."""
    path = version_dir(images_dir, image.name, image.version) / a.filename
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return path, "missing"
    return path, (None if size == a.size else "size")


def artifact_url(image: Image, a: ImageArtifact) -> str:
    return f"/boot/v1/images/{image.name}/{image.version}/{a.filename}"


def to_detail(session: Session, image: Image) -> ImageDetail:
    manifest = image.manifest or {}
    return ImageDetail(
        **to_public(image).model_dump(),
        artifacts=[
            ArtifactPublic(
                kind=a.kind, filename=a.filename, size=a.size, sha256=a.sha256, url=artifact_url(image, a)
            )
            for a in artifacts(session, image)
        ],
        packages=len(manifest.get("packages") or {}),
        layers=list(manifest.get("recipes") or manifest.get("chain") or []),
    )


def listing(session: Session) -> list[ImagePublic]:
    return [to_public(i) for i in session.exec(select(Image).order_by(col(Image.name), col(Image.id)))]


def find_artifact(session: Session, name: str, version: str, filename: str) -> tuple[Image, ImageArtifact]:
    image = session.exec(
        select(Image).where(Image.name == name, Image.version == version, Image.state == ImageState.READY)
    ).first()
    if image is None:
        raise NotFound(f"no ready image {name} version {version}")
    for a in artifacts(session, image):
        if a.filename == filename:
            return image, a
    raise NotFound(f"image {name} version {version} has no artifact {filename!r}")
