"""Install to the node's own disk (#30): set install modes and disk layouts, decide at each boot whether an
install is due, hand the image's init its plan, and record what the disk holds and what the node runs.

A provisioning node whose effective mode is not ``stateless`` gets, at its PXE boot:

- the ``install`` purpose (the image's kernel and initramfs, ``bcm.install=<url>``) when an install is due:
  always for ``full`` and ``auto`` (``auto`` syncs when the disk holds a complete install of the same layout,
  else installs in full), for ``nosync`` only when nothing complete is installed;
- the ``local`` purpose (boot the disk) otherwise: the installed system calls back with the agent token its
  install's callback stored on the disk (``POST /boot/v1/hello/disk``).

The init fetches its plan with the boot's one-time token (``GET /boot/v1/install/{mac}``): from then on the
disk is ``installing``; it reports ``installed`` (``POST /boot/v1/installed``) only after everything is synced,
so a power cut during ``full`` installs again at the next boot. A data node refuses a ``full`` install (and an
``auto`` one that must repartition) unless an admin confirmed the wipe, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlmodel import Session, col, select

from bcm.domain import disk_layout as dl
from bcm.domain.inheritance import effective_settings
from bcm.domain.states import State, Verb, next_state
from bcm.errors import Conflict, Forbidden, InvalidInput, NotFound
from bcm.models.base import utcnow
from bcm.models.category import Category, CategoryInstallUpdate
from bcm.models.node import Interface, Node, NodeInstallUpdate
from bcm.services import events

ACTOR = "bcm:install"
WIPING = ("full",)


# ---- modes and layouts -----------------------------------------------------------------------------------


def category_of(session: Session, node: Node) -> Category | None:
    return session.get(Category, node.category_id) if node.category_id else None


def inherited_mode(node: Node, cat: Category | None) -> str:
    """The node's own mode, else its category's, else stateless (one boot's ``next_install_mode`` aside)."""
    values = effective_settings(
        {"install_mode": node.install_mode}, {"install_mode": cat.install_mode} if cat else None
    )
    return str(values.values["install_mode"] or "stateless")


def effective_mode(node: Node, cat: Category | None) -> str:
    return node.next_install_mode or inherited_mode(node, cat)


def layout_of(cat: Category | None) -> dl.DiskLayout | None:
    return dl.parse_layout(cat.disk_layout) if cat is not None and cat.disk_layout else None


def _disks(node: Node) -> list[dict[str, Any]] | None:
    disks = (node.facts or {}).get("disks")
    return disks if isinstance(disks, list) and disks else None


def check_fits(node: Node, layout: dl.DiskLayout | None, mode: str) -> list[dl.ChosenDisk]:
    """The layout against the node's inventoried disks (a 422 naming what does not fit, and the node)."""
    if mode == "stateless":
        return []
    if layout is None:
        raise InvalidInput(
            f"disk_layout: node {node.name} installs to disk ({mode}) but its category has no "
            "disk layout (bcm category install CATEGORY --layout FILE)",
            field="disk_layout",
        )
    try:
        return dl.choose_disks(layout, _disks(node))
    except InvalidInput as exc:
        raise InvalidInput(f"node {node.name}: {exc.message}", field=exc.field) from None


def _wipes(node: Node, mode: str, layout: dl.DiskLayout | None) -> bool:
    """Whether a boot in ``mode`` may wipe the node's disks: full always; auto when it must repartition."""
    if mode == "full":
        return True
    if mode == "auto":
        return not (
            node.install_state == "installed"
            and layout is not None
            and node.installed_layout == dl.layout_hash(layout)
        )
    if mode == "nosync":
        return node.install_state != "installed"
    return False


def _confirm(
    session: Session, nodes: list[Node], confirm: bool, is_admin: bool, actor: str, field: str
) -> None:
    if not nodes:
        return
    names = ", ".join(n.name for n in nodes[:10]) + (" …" if len(nodes) > 10 else "")
    if not confirm:
        raise Conflict(
            f"{field}: {names} {'is a data node' if len(nodes) == 1 else 'are data nodes'}: a full install "
            "wipes its disks; an admin confirms the wipe (--confirm-wipe)",
            field=field,
        )
    if not is_admin:
        raise Forbidden(
            "confirm_wipe: only an admin may confirm wiping a data node's disks", field="confirm_wipe"
        )
    for n in nodes:
        n.wipe_confirmed = True
        session.add(n)
        events.record(
            session,
            actor,
            "node.install",
            n.name,
            "data node: an admin confirmed wiping its disks (once)",
            severity="warning",
        )


def set_node(session: Session, name: str, body: NodeInstallUpdate, actor: str, is_admin: bool) -> Node:
    from bcm.services import nodes as node_svc

    node = node_svc.get(session, name)
    if body.confirm_wipe and not is_admin:
        raise Forbidden(
            "confirm_wipe: only an admin may confirm wiping a data node's disks", field="confirm_wipe"
        )
    changes = body.model_dump(exclude_unset=True, exclude={"confirm_wipe"})
    if "data_node" in changes and changes["data_node"] is None:
        raise InvalidInput("data_node: true or false", field="data_node")
    for field, value in changes.items():
        setattr(node, field, value)
    if "data_node" in changes:
        node.wipe_confirmed = False  # a confirmation is for the data node as it was when confirmed
    cat = category_of(session, node)
    mode = effective_mode(node, cat)
    if mode != "stateless":
        check_fits(node, layout_of(cat), mode)
    if node.data_node and not node.wipe_confirmed and _wipes(node, mode, layout_of(cat)):
        field = "next_install_mode" if node.next_install_mode else "install_mode"
        _confirm(session, [node], body.confirm_wipe, is_admin, actor, field)
    node.updated_at = utcnow()
    session.add(node)
    what = ", ".join(f"{k}={v}" for k, v in changes.items()) or "unchanged"
    events.record(session, actor, "node.install", node.name, f"install settings: {what} (effective {mode})")
    session.flush()
    return node


def members(session: Session, cat: Category) -> list[Node]:
    return list(
        session.exec(select(Node).where(Node.category_id == cat.id).order_by(col(Node.name)).limit(100000))
    )


def set_category(
    session: Session, name: str, body: CategoryInstallUpdate, actor: str, is_admin: bool
) -> Category:
    from bcm.services import categories as cat_svc

    cat = cat_svc.get(session, name)
    if body.confirm_wipe and not is_admin:
        raise Forbidden(
            "confirm_wipe: only an admin may confirm wiping a data node's disks", field="confirm_wipe"
        )
    changes = body.model_dump(exclude_unset=True, exclude={"confirm_wipe"})
    layout = None
    if "disk_layout" in changes and changes["disk_layout"] is not None:
        layout = dl.parse_layout(changes["disk_layout"])
        changes["disk_layout"] = layout.model_dump(mode="json", exclude_defaults=True)
    for field, value in changes.items():
        setattr(cat, field, value)
    layout = layout_of(cat)
    wiped = []
    for node in members(session, cat):
        mode = effective_mode(node, cat)
        if mode != "stateless":
            check_fits(node, layout, mode)
            if node.data_node and not node.wipe_confirmed and _wipes(node, mode, layout):
                wiped.append(node)
    _confirm(session, wiped, body.confirm_wipe, is_admin, actor, "install_mode")
    session.add(cat)
    what = (
        ", ".join(f"{k}={'(layout)' if k == 'disk_layout' and v else v}" for k, v in changes.items())
        or "unchanged"
    )
    events.record(session, actor, "category.install", cat.name, f"install settings: {what}")
    session.flush()
    return cat


# ---- at boot ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BootPlan:
    """What a provisioning node's boot does with its disk: ``stateless``, ``install`` (mode full or auto),
    ``local`` (boot what is installed), or ``refused`` (why: nothing to boot; the node fails)."""

    what: str
    mode: str = "stateless"
    why: str = ""


def boot_plan(session: Session, node: Node) -> BootPlan:
    cat = category_of(session, node)
    mode = effective_mode(node, cat)
    if mode == "stateless":
        return BootPlan("stateless")
    try:
        layout = layout_of(cat)
        check_fits(node, layout, mode)
    except InvalidInput as exc:
        return BootPlan("refused", mode, f"install ({mode}): {exc.message}")
    installed = node.install_state == "installed"
    if mode == "nosync" and installed:
        return BootPlan("local", mode)
    plan_mode = "auto" if mode == "auto" and not _wipes(node, mode, layout) else "full"
    if node.data_node and plan_mode == "full" and not node.wipe_confirmed:
        return BootPlan(
            "refused",
            mode,
            f"install ({mode}): {node.name} is a data node and a full install would wipe "
            "its disks; an admin confirms it (bcm node install NODE --mode full --confirm-wipe)",
        )
    return BootPlan("install", plan_mode)


def plan_script(session: Session, settings: Any, node: Node, mac: str) -> str:
    """The init's install plan (bcm.domain.disk_layout.render_plan); the disk is ``installing`` from now."""
    from bcm.services import pxe

    plan = boot_plan(session, node)
    if plan.what != "install":
        raise Conflict(
            f"node {node.name} has no install due ({plan.what}{': ' + plan.why if plan.why else ''})"
        )
    cat = category_of(session, node)
    layout = layout_of(cat)
    assert layout is not None
    chosen = check_fits(node, layout, plan.mode)
    image, _, _ = pxe.effective_image(session, node)
    version = pxe._ready_version(session, image) if image else None
    if version is None:
        raise NotFound(f"node {node.name}: no ready image to install")
    node.install_state = "installing"
    node.updated_at = utcnow()
    session.add(node)
    events.record(
        session,
        ACTOR,
        "node.install",
        node.name,
        f"{plan.mode} install of {version.name}:{version.version} started: the disk is installing",
    )
    source = delta_source(session, settings, node) if plan.mode == "auto" else None
    return dl.render_plan(
        layout,
        chosen,
        mode=plan.mode,
        image=f"{version.name}:{version.version}",
        server_url=pxe.server_url(settings),
        mac=mac,
        delta=(
            dl.DeltaPlan(
                from_image=source.from_image,
                url=f"{pxe.server_url(settings)}/boot/v1/install/{mac}/delta",
                initrd_sha256=source.initrd_sha256,
            )
            if source is not None
            else None
        ),
    )


@dataclass(frozen=True)
class DeltaSource:
    """An `auto` install that can sync by the changed files alone: the disk holds ``from_image`` (bcm's
    record; the init checks the disk's own), the node gets ``to_image``."""

    from_image: str
    to_image: str
    old_rootfs: Path
    new_rootfs: Path
    out: Path
    skip: tuple[str, ...]
    initrd_sha256: str


def delta_source(session: Session, settings: Any, node: Node) -> DeltaSource | None:
    """None where the disk's image is not an older ready version of the one the node gets (another image,
    the same version, a version pruned since): the init then fetches the whole root image and syncs from it."""
    from bcm.drivers import imagedelta
    from bcm.services import images as image_svc
    from bcm.services import pxe

    if not node.installed_image or ":" not in node.installed_image:
        return None
    name, from_version = node.installed_image.rsplit(":", 1)
    image_name, _, _ = pxe.effective_image(session, node)
    new = pxe._ready_version(session, image_name) if image_name == name else None
    if new is None or new.version == from_version:
        return None
    try:
        old = image_svc.get(session, name, from_version)
    except NotFound:
        return None
    if old.state != "ready":
        return None
    files = {}
    for row in (old, new):
        arts = {a.kind: a for a in image_svc.artifacts(session, row)}
        if "rootfs" not in arts or "initramfs" not in arts:
            return None
        files[row.version] = arts
    old_rootfs = (
        image_svc.version_dir(settings.images_dir, name, old.version) / files[old.version]["rootfs"].filename
    )
    new_rootfs = (
        image_svc.version_dir(settings.images_dir, name, new.version) / files[new.version]["rootfs"].filename
    )
    if not (old_rootfs.is_file() and new_rootfs.is_file()):
        return None
    layout = layout_of(category_of(session, node))
    # the layout's other filesystems are the node's (data, scratch): a sync of the root never reaches them
    mounts = (
        sorted(
            {p.mount for d in layout.disks for p in d.partitions if p.mount and p.mount != "/"}
            | {a.mount for a in layout.raid if a.mount and a.mount != "/"}
        )
        if layout is not None
        else []
    )
    key = dl.layout_hash(layout) if layout is not None else "none"
    return DeltaSource(
        from_image=node.installed_image,
        to_image=f"{name}:{new.version}",
        old_rootfs=old_rootfs,
        new_rootfs=new_rootfs,
        out=image_svc.version_dir(settings.images_dir, name, new.version)
        / "delta"
        / f"from-{old.version}-{key}.tar.gz",
        skip=(*imagedelta.SKIP, *mounts),
        initrd_sha256=files[new.version]["initramfs"].sha256,
    )


def delta_for(session: Session, settings: Any, node: Node) -> DeltaSource:
    """The delta the init asks for after its plan: only during an `auto` install with a source (else 409)."""
    if node.install_state != "installing" or effective_mode(node, category_of(session, node)) != "auto":
        raise Conflict(f"node {node.name} has no auto install in progress: no delta")
    source = delta_source(session, settings, node)
    if source is None:
        raise Conflict(f"node {node.name}: no older ready version of its image on its disk: no delta")
    return source


def installed(
    session: Session, node: Node, image: str, layout: str, mode: str, bytes_written: int | None
) -> None:
    """The init synced everything: the disk holds ``image`` in ``layout``."""
    node.install_state = "installed"
    node.installed_image = image[:200]
    node.installed_layout = layout[:16]
    node.installed_at = utcnow()
    node.install_bytes = bytes_written
    if mode == "full":
        node.wipe_confirmed = False  # used up
    node.updated_at = utcnow()
    session.add(node)
    events.record(
        session,
        ACTOR,
        "node.install",
        node.name,
        f"{mode} install of {image} done ({bytes_written if bytes_written is not None else '?'} bytes written)",
    )


def booted(session: Session, node: Node, image: str | None) -> None:
    """At the node's callback: what it runs, and one boot's install mode is spent."""
    cat = category_of(session, node)
    from_disk = effective_mode(node, cat) != "stateless" and node.install_state == "installed"
    node.booted_from = "disk" if from_disk else "network"
    node.booted_image = (node.installed_image if from_disk else image) or None
    node.next_install_mode = None
    session.add(node)


def disk_hello(session: Session, node_id: int, mac: str, peer: str | None) -> Node:
    """An installed system booted from its disk calls back with its agent token (no one-time token reaches a
    disk boot): a provisioning node is booted; any other is left as it is."""
    node = session.get(Node, node_id)
    if node is None:
        raise NotFound("node gone")
    iface = session.exec(select(Interface).where(Interface.mac == mac, Interface.node_id == node.id)).first()
    if iface is None:
        raise Forbidden(f"mac: {mac} is not a MAC of node {node.name}", field="mac")
    if node.install_state != "installed":
        raise Conflict(
            f"node {node.name}: bcm records no complete install on its disk ({node.install_state})"
        )
    if node.provision_state == State.PROVISIONING.value:
        node.provision_state = next_state(node.name, node.provision_state, Verb.BOOT_DONE).value
        node.target_state = None
        node.last_error = None
        node.provision_queued_at = node.provision_started_at = node.provision_deadline = None
    node.booted_from, node.booted_image, node.next_install_mode = "disk", node.installed_image, None
    node.updated_at = utcnow()
    session.add(node)
    events.record(
        session,
        ACTOR,
        "node.booted",
        node.name,
        f"booted {node.installed_image} from its disk; called back from {peer or 'unknown'} ({mac})",
    )
    session.flush()
    return node
