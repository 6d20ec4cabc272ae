"""Image push (BCM's imageupdate): which tree goes to which nodes, who may receive it, what is recorded.

The tree of a version is its top layer in the build cache (``Image.layer_key``); when that is gone,
its published ``rootfs.squashfs`` unpacked once (bcm.drivers.sync.unpack_squashfs). A push is never a
node's first contact: a node without a pinned host key (or without an address) is refused with a
per-node result, not trusted. A node an ``--apply`` push reached records the version it now runs as an
``image.push`` event. Services flush, never commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bcm.drivers import imagebuild
from bcm.drivers.sync import PushTarget
from bcm.errors import Conflict
from bcm.models.base import utcnow
from bcm.models.image import Image, ImageState
from bcm.models.node import Node
from bcm.services import events
from bcm.services import images as images_svc
from bcm.services.inventory import load_targets

NO_HOST_KEY = (
    "no pinned SSH host key: a push is never first contact; run `bcm node inventory` once "
    "(it pins the key) or `bcm node rekey --key`"
)


@dataclass(frozen=True)
class PushSource:
    """Where the tree of an image version is, or how to get it back (its squashfs and sha256)."""

    name: str
    version: str
    recipe: str
    layer_tree: Path | None  # the cached layer, when it is complete
    squashfs: Path | None
    squashfs_sha256: str | None


def ready_version(session: Session, name: str, version: str | None) -> Image:
    """The version to push (default: the current one); only a ready version can be pushed."""
    image = images_svc.get(session, name, version)
    if image.state != ImageState.READY:
        raise Conflict(
            f"image {name} version {image.version} is {image.state}; only a ready version can be pushed"
        )
    return image


def source_of(session: Session, image: Image, cache_dir: Path, images_dir: Path) -> PushSource:
    tree = None
    if image.layer_key:
        layer = imagebuild.layer_dir(cache_dir, image.layer_key)
        if (layer / imagebuild.MARKER).exists() and (layer / "rootfs").is_dir():
            tree = layer / "rootfs"
    rootfs = next((a for a in images_svc.artifacts(session, image) if a.kind == "rootfs"), None)
    squashfs = (
        images_svc.version_dir(images_dir, image.name, image.version) / rootfs.filename if rootfs else None
    )
    return PushSource(
        name=image.name,
        version=image.version,
        recipe=image.recipe or image.name,
        layer_tree=tree,
        squashfs=squashfs,
        squashfs_sha256=rootfs.sha256 if rootfs else None,
    )


def targets(
    engine: Engine, names: list[str], port: int
) -> tuple[list[PushTarget], dict[str, dict[str, Any]]]:
    """Push targets for nodes with an address and a pinned key; a refusal result for every other node."""
    found, missing = load_targets(engine, names)
    refused: dict[str, dict[str, Any]] = {
        n: {"status": "no_address", "message": why} for n, why in missing.items()
    }
    ready = []
    for t in found:
        if t.pinned_key:
            ready.append(PushTarget(t.name, t.address, t.pinned_key, port))
        else:
            refused[t.name] = {"status": "no_host_key", "message": NO_HOST_KEY}
    return ready, refused


def record_pushed(session: Session, actor: str, name: str, version: str, nodes: list[str]) -> None:
    """Each node that now runs ``name:version`` records it, with one ``image.push`` event per node."""
    now = utcnow()
    for node in session.exec(select(Node).where(col(Node.name).in_(nodes))):
        node.running_image = f"{name}:{version}"[:200]
        node.image_pushed_at = now
        session.add(node)
    for node_name in nodes:
        events.record(session, actor, "image.push", node_name, f"{name}:{version}")
    session.flush()
