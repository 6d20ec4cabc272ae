"""PXE provisioning use cases: which boot script a machine gets, discovery, assignment, the one-time boot
token and the callback that trades it for an agent token, the per-node overlay, and the provisioning queue.

Purposes (one iPXE template each, as MAAS does): ``discovery`` for an unknown or discovered MAC; ``image``
for a provisioning node whose effective image is ready (kernel, initramfs, root image, overlay, and a
one-time token on the kernel command line); ``noimage`` for a provisioning node with no image to boot (the
node fails with ``last_error`` and an event); ``refused`` for a client that may not have the provisioning
node's token (not its lease, or not the address its attempt is bound to; the node is left alone);
``local`` for every other known node (an installed node boots its disk); ``install`` (#30, bcm.services.install)
for a provisioning node whose disk install is due: ``image`` plus the installer's ``bcm.install=<plan url>``.

Boot trust (#26): one token per provisioning attempt, bound to the first client address that fetched the
script (with bcm's DHCP that must be the MAC's lease); overlay and hello only from that address; the
overlay with bcm's host private key once per attempt; the node's address of record is the socket's.
"""

from __future__ import annotations

import hashlib
import io
import ipaddress
import json
import secrets
import tarfile
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import func
from sqlmodel import Session, col, select

from bcm.domain.facts import HardwareFacts
from bcm.domain.inheritance import effective_settings
from bcm.domain.kernel_args import check_kernel_args
from bcm.domain.naming import normalize_mac
from bcm.domain.power import BmcProtocol, parse_bmc_address, target_key
from bcm.domain.states import State, Verb, next_state
from bcm.errors import Conflict, Forbidden, InvalidInput, NotFound, Unauthorized
from bcm.models.base import utcnow
from bcm.models.category import Category
from bcm.models.image import Image, ImageArtifact
from bcm.models.node import Interface, Node
from bcm.models.pxe import (
    AssignRequest,
    BootToken,
    DiscoveredBmc,
    DiscoveryAccepted,
    DiscoveryReport,
    PxeConfig,
    PxeConfigUpdate,
)
from bcm.services import events, tls
from bcm.services import images as image_svc
from bcm.services import install as install_svc
from bcm.services import nodes as node_svc
from bcm.services import secrets as secret_svc
from bcm.services.render import render
from bcm.settings import PxeSettings, Settings

ACTOR = "bcm:pxe"
TOKEN_PREFIX = "bcmboot_"  # noqa: S105 - a prefix, not a secret
DISCOVERED_PREFIX = "mac-"
LOCAL_BOOT_MODES = frozenset({"local", "disk"})
NODE_CA_PATH = "/etc/bcm/ca.pem"  # bcm's API CA on a booted node (its overlay); the agent verifies against it


@dataclass(frozen=True)
class BootScript:
    purpose: str
    text: str
    node: str | None = None


def server_url(settings: Settings) -> str:
    """How nodes reach bcm's boot files over HTTP (while the API speaks TLS: the plain boot port)."""
    if settings.pxe.server_url:
        return settings.pxe.server_url.rstrip("/")
    host = settings.pxe.address or settings.host
    return f"http://{host}:{settings.tls.boot_port if settings.tls.enabled else settings.port}"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def node_by_mac(session: Session, mac: str) -> Node | None:
    iface = session.exec(select(Interface).where(Interface.mac == mac)).first()
    return session.get(Node, iface.node_id) if iface is not None else None


def entry_script(settings: Settings) -> str:
    return render("ipxe/boot.ipxe.j2", server_url=server_url(settings))


# ---- settings set through the API -----------------------------------------------------------------------

CONFIG_FIELDS = ("interface", "address", "mode", "range_start", "range_end", "netmask", "router")


def stored_config(session: Session) -> PxeConfig | None:
    return session.exec(select(PxeConfig).order_by(col(PxeConfig.id))).first()


def effective(settings: Settings, row: PxeConfig | None) -> PxeSettings:
    """BCM_PXE__* settings, overridden by what `bcm pxe enable|disable` stored."""
    if row is None:
        return settings.pxe
    update: dict[str, Any] = {f: getattr(row, f) for f in CONFIG_FIELDS}
    update["enabled"] = row.enabled
    return settings.pxe.model_copy(update=update)


def update_config(session: Session, settings: Settings, body: PxeConfigUpdate, actor: str) -> PxeSettings:
    """Store new PXE settings once dnsmasq accepts the config they make (else 422/502, nothing stored)."""
    from bcm.drivers import dnsmasq

    row = stored_config(session)
    current = effective(settings, row)
    changes = body.model_dump(exclude_unset=True)
    candidate = current.model_copy(update=changes)
    if candidate.mode == "proxy":
        candidate = candidate.model_copy(update={"range_start": None, "range_end": None})
    if candidate.enabled:
        trial = settings.model_copy(update={"pxe": candidate})
        try:
            dnsmasq.validate(trial, server_url(trial) + "/boot/v1/ipxe/boot.ipxe")
        except InvalidInput as exc:  # named as the request names it (range_start, not pxe.range_start)
            field = (exc.field or "body").removeprefix("pxe.")
            message = exc.message.removeprefix("pxe.").split(" (BCM_PXE__")[0]
            raise InvalidInput(message, field=field) from None
    if row is None:
        row = PxeConfig()
    for f in CONFIG_FIELDS:
        setattr(row, f, getattr(candidate, f))
    row.enabled, row.updated_by, row.updated_at = candidate.enabled, actor[:64], utcnow()
    session.add(row)
    what = f"{candidate.mode} on {candidate.interface} ({candidate.address})" if candidate.enabled else "off"
    events.record(
        session, actor, "pxe.config", "pxe", f"PXE {'enabled' if candidate.enabled else 'disabled'}: {what}"
    )
    session.flush()
    return candidate


# ---- images a machine boots --------------------------------------------------------------------------


def effective_image(session: Session, node: Node) -> tuple[str | None, str, str]:
    """(image name, boot mode, kernel arguments) after category inheritance."""
    cat = session.get(Category, node.category_id) if node.category_id else None
    values = effective_settings(node.model_dump(), cat.model_dump() if cat else None).values
    return values["image"], str(values["boot_mode"] or "pxe"), str(values["kernel_args"] or "")


def _ready_version(session: Session, name: str) -> Image | None:
    try:
        image = image_svc.get(session, name)
    except NotFound:
        return None
    return image if image.state == "ready" else None


def discovery_image(session: Session, settings: Settings) -> Image | None:
    """The configured discovery image, else the newest ready image of any name."""
    if settings.pxe.discovery_image:
        return _ready_version(session, settings.pxe.discovery_image)
    return session.exec(
        select(Image)
        .where(Image.state == "ready", col(Image.is_current))
        .order_by(col(Image.published_at).desc())
    ).first()


def _artifact_urls(session: Session, settings: Settings, image: Image) -> dict[str, ImageArtifact]:
    """kernel, initramfs and rootfs of a version, each present on disk at its published size."""
    found = {a.kind: a for a in image_svc.artifacts(session, image)}
    for kind in ("kernel", "initramfs", "rootfs"):
        a = found.get(kind)
        if a is None:
            raise NotFound(f"image {image.name}:{image.version} has no {kind}")
        _, problem = image_svc.artifact_problem(settings.images_dir, image, a)
        if problem == "missing":
            raise NotFound(f"image {image.name}:{image.version}: {a.filename} is missing on the server")
        if problem == "size":
            raise NotFound(
                f"image {image.name}:{image.version}: {a.filename} is not the size recorded at publish"
            )
    return found


def _url(settings: Settings, image: Image, a: ImageArtifact) -> str:
    return server_url(settings) + image_svc.artifact_url(image, a)


def boot_script(
    session: Session,
    settings: Settings,
    mac: str,
    *,
    peer: str | None = None,
    leased: tuple[str, ...] = (),
    check_lease: bool = False,
) -> BootScript:
    """The iPXE script for the machine that booted from ``mac`` (the caller commits: tokens, events).

    With ``check_lease`` (bcm's own DHCP), a script with a boot token is answered only to one of ``leased``,
    the addresses dnsmasq gave that MAC (iPXE's, and an installed system's own DHCP client's); in any mode only to the address the attempt is bound to (the first one
    that fetched it): someone who merely knows a provisioning node's MAC gets no token."""
    node = node_by_mac(session, mac)
    if node is None or node.provision_state == State.DISCOVERED.value:
        return _discovery(session, settings, mac, node)
    if node.provision_state != State.PROVISIONING.value:
        return _local(node)
    name, mode, kernel_args = effective_image(session, node)
    if mode in LOCAL_BOOT_MODES:
        return _local(node)
    plan = install_svc.boot_plan(session, node)  # install to disk (#30)
    if plan.what == "refused":
        return _no_image(session, node, plan.why)
    if plan.what == "local":  # an installed node whose install is not due: its disk calls back (agent token)
        events.record(
            session, ACTOR, "boot.script", node.name, f"boots {node.installed_image} from its disk ({mac})"
        )
        return _local(node)
    try:  # checked when set; checked again here for values stored before the check existed
        kernel_args = check_kernel_args(kernel_args)
    except InvalidInput as exc:
        return _no_image(session, node, exc.message)
    image = _ready_version(session, name) if name else None
    if image is None:
        why = "no image assigned" if not name else f"image {name} has no ready version"
        return _no_image(session, node, why)
    try:
        found = _artifact_urls(session, settings, image)
    except NotFound as exc:
        return _no_image(session, node, exc.message)
    if check_lease and peer not in leased:
        return _refused(
            session,
            node,
            mac,
            peer,
            f"{mac} has {'the leases ' + ', '.join(leased) if leased else 'no lease'}",
            f"this address is not the one leased to {mac}",
        )
    token, bound = boot_token_for(session, settings, node, mac, peer)
    if token is None:
        return _refused(
            session,
            node,
            mac,
            peer,
            f"this boot is bound to {bound}",
            f"{peer or 'this client'} is not the address this boot is bound to",
        )
    kernel, initrd, rootfs = found["kernel"], found["initramfs"], found["rootfs"]
    # the operator's parameters first, bcm's own last: the image's init keeps the last value of each
    cmdline = " ".join(
        a
        for a in [
            settings.pxe.kernel_args,
            kernel_args,
            f"bcm.root={_url(settings, image, rootfs)}",
            f"bcm.root_sha256={rootfs.sha256}",
            f"bcm.overlay={server_url(settings)}/boot/v1/overlay/{mac}",
            f"bcm.server={server_url(settings)}",
            f"bcm.node={node.name}",
            f"bcm.mac={mac}",
            f"bcm.token={token}",
            *(
                [
                    f"bcm.install={server_url(settings)}/boot/v1/install/{mac}",
                    f"bcm.initrd={_url(settings, image, initrd)}",
                ]
                if plan.what == "install"
                else []
            ),
        ]
        if a
    )
    how = f"{plan.mode} install of" if plan.what == "install" else "image"
    events.record(session, ACTOR, "boot.script", node.name, f"{how} {image.name}:{image.version} for {mac}")
    text = render(
        "ipxe/image.ipxe.j2",
        node=node.name,
        install=plan.mode if plan.what == "install" else None,
        image=f"{image.name}:{image.version}",
        kernel_url=_url(settings, image, kernel),
        initrd_url=_url(settings, image, initrd),
        cmdline=cmdline,
    )
    return BootScript("install" if plan.what == "install" else "image", text, node.name)


def _local(node: Node) -> BootScript:
    """Boot the next boot device; a node with an installed disk boots its first disk (BIOS drive 0x80)."""
    disk = node.install_state == "installed"
    text = render("ipxe/local.ipxe.j2", node=node.name, state=node.provision_state, disk=disk)
    return BootScript("local", text, node.name)


def _discovery(session: Session, settings: Settings, mac: str, node: Node | None) -> BootScript:
    image = discovery_image(session, settings)
    found = None
    if image is not None:
        try:
            found = _artifact_urls(session, settings, image)
        except NotFound:
            found = None
    if image is None or found is None:
        events.record(
            session, ACTOR, "boot.discovery", mac, "no ready discovery image to boot", severity="warning"
        )
        message = "no discovery image is ready (build one: bcm image build base)"
        return BootScript("noimage", render("ipxe/noimage.ipxe.j2", node=mac, message=message))
    cmdline = f"{settings.pxe.kernel_args} bcm.discover={server_url(settings)}/boot/v1/discover bcm.mac={mac}"
    text = render(
        "ipxe/discovery.ipxe.j2",
        mac=mac,
        image=f"{image.name}:{image.version}",
        kernel_url=_url(settings, image, found["kernel"]),
        initrd_url=_url(settings, image, found["initramfs"]),
        cmdline=cmdline.strip(),
    )
    return BootScript("discovery", text, node.name if node else None)


def _refused(session: Session, node: Node, mac: str, peer: str | None, why: str, message: str) -> BootScript:
    """No token for this client: the node's own boot (and token) is left as it was; one event a minute."""
    events.record_unauthenticated(
        session, ACTOR, "boot.script", node.name, f"refused to {peer or 'unknown'}: {why}", source=peer
    )
    return BootScript("refused", render("ipxe/refused.ipxe.j2", node=node.name, message=message), node.name)


def _no_image(session: Session, node: Node, why: str) -> BootScript:
    """A provisioning node with nothing to boot fails now (not after the timeout), with an event."""
    fail(session, node, f"provisioning: {why}")
    return BootScript("noimage", render("ipxe/noimage.ipxe.j2", node=node.name, message=why), node.name)


# ---- one-time boot tokens and the callback ------------------------------------------------------------


def current_boot_token(session: Session, node: Node) -> BootToken | None:
    """The token of the node's current provisioning attempt, if its script was fetched."""
    return session.exec(
        select(BootToken)
        .where(BootToken.node_id == node.id, col(BootToken.used_at).is_(None))
        .order_by(col(BootToken.id).desc())
    ).first()


def boot_token_for(
    session: Session, settings: Settings, node: Node, mac: str, peer: str | None
) -> tuple[str | None, str | None]:
    """(token, bound address): the attempt's token for ``peer``, minted and bound to it at the first fetch;
    (None, bound) when the attempt is bound to another address (its token stays as it is)."""
    assert node.id is not None
    row = current_boot_token(session, node)
    if row is not None and row.client_address and row.token_enc and row.expires_at > utcnow():
        if peer != row.client_address:
            return None, row.client_address
        return secret_svc.decrypt(settings.state_dir, row.token_enc), row.client_address
    if not peer:
        return None, "a known client address"
    for old in session.exec(
        select(BootToken).where(BootToken.node_id == node.id, col(BootToken.used_at).is_(None))
    ):
        session.delete(old)  # expired, or minted before tokens were bound
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    expires = node.provision_deadline or utcnow() + timedelta(seconds=settings.pxe.provision_timeout_s)
    session.add(
        BootToken(
            node_id=node.id,
            mac=mac,
            token_hash=hash_token(token),
            expires_at=expires,
            client_address=peer,
            token_enc=secret_svc.encrypt(settings.state_dir, token),
        )
    )
    return token, peer


def end_attempts(session: Session, nodes: list[Node]) -> None:
    """A new provision/reimage attempt: the unused tokens of earlier ones stop working."""
    ids = [n.id for n in nodes]
    for i in range(0, len(ids), 500):
        for old in session.exec(
            select(BootToken).where(
                col(BootToken.node_id).in_(ids[i : i + 500]), col(BootToken.used_at).is_(None)
            )
        ):
            session.delete(old)


def _refuse(session: Session, mac: str, why: str, peer: str | None, node: str | None = None) -> None:
    events.record_unauthenticated(
        session,
        ACTOR,
        "boot.token",
        node or mac,
        f"refused from {peer or 'unknown'} ({mac}): {why}",
        source=peer,
    )
    session.commit()


def check_boot_token(
    session: Session, mac: str, token: str | None, peer: str | None
) -> tuple[Node, BootToken]:
    """The node a one-time token belongs to, checked against Ironic's rule and the address the boot is
    bound to; a refusal is recorded (the caller brakes the client). Using it up is the caller's."""
    if not token:
        raise Unauthorized(
            "no boot token: send `Authorization: Bearer <bcm.token from the kernel command line>`"
        )
    row = session.exec(select(BootToken).where(BootToken.token_hash == hash_token(token))).first()
    if row is None:
        _refuse(session, mac, "unknown boot token", peer)
        raise Unauthorized("boot token not valid")
    node = session.get(Node, row.node_id)
    name = node.name if node else None
    if row.mac != mac:
        _refuse(session, mac, f"the token was issued for another machine ({row.mac})", peer, name)
        raise Forbidden("this boot token belongs to another machine")
    if row.used_at is not None:
        _refuse(session, mac, "the token was used already", peer, name)
        raise Unauthorized("boot token used already")
    if row.expires_at <= utcnow():
        _refuse(session, mac, "the token expired", peer, name)
        raise Unauthorized("boot token expired")
    if not row.client_address or peer != row.client_address:
        _refuse(session, mac, f"the boot is bound to {row.client_address or 'no address'}", peer, name)
        raise Forbidden("this boot token is bound to another client address")
    if node is None or node.provision_state != State.PROVISIONING.value:
        _refuse(
            session, mac, f"node is {node.provision_state if node else 'gone'}, not provisioning", peer, name
        )
        raise Conflict(f"node {name} is not provisioning")
    return node, row


def host_key_source(session: Session, node: Node) -> str:
    """``bcm`` (bcm makes the key, the overlay carries it) or ``node`` (the node makes it), by category."""
    cat = session.get(Category, node.category_id) if node.category_id else None
    return (cat.host_key_source if cat else None) or "bcm"


def boot_failed(session: Session, mac: str, token: str | None, peer: str | None, message: str) -> Node:
    """The node's init reports that its boot failed: the attempt's token is used up and the node fails, with
    the init's line in last_error (what the console shows), at once rather than at the deadline."""
    node, row = check_boot_token(session, mac, token, peer)
    row.used_at, row.token_enc = utcnow(), None
    session.add(row)
    fail(session, node, f"provisioning: the boot failed on the node ({peer or 'unknown'}): {message}")
    session.flush()
    return node


def hello(
    session: Session, mac: str, token: str | None, peer: str | None, host_key: str | None = None
) -> tuple[Node, str]:
    """A booted node's callback: the one-time token becomes its agent token; provisioning → booted. The
    node's address of record is the connection's (the bound address), never a header or a field."""
    from bcm.services import agents as agent_svc

    node, row = check_boot_token(session, mac, token, peer)
    if host_key_source(session, node) == "node":
        if host_key is None:  # the token stays usable: a fixed bcm-hello may call again
            raise InvalidInput(
                "host_key: this node makes its own SSH host key; send its public key", field="host_key"
            )
        node_svc.pin_host_key(
            session, node, host_key, ACTOR, "made by the node at boot (host_key_source node)"
        )
    row.used_at, row.token_enc = utcnow(), None
    session.add(row)
    _, secret = agent_svc.issue_node_token(session, node.name, ACTOR)
    node.provision_state = next_state(node.name, node.provision_state, Verb.BOOT_DONE).value
    node.target_state = None
    node.last_error = None
    node.provision_queued_at = node.provision_started_at = node.provision_deadline = None
    node.updated_at = utcnow()
    name, _, _ = effective_image(session, node)
    ready = _ready_version(session, name) if name else None
    install_svc.booted(session, node, f"{ready.name}:{ready.version}" if ready else None)
    session.add(node)
    iface = session.exec(select(Interface).where(Interface.mac == mac)).first()
    if iface is not None and iface.ip is None and peer:
        taken = session.exec(select(Interface).where(Interface.ip == peer)).first()
        if taken is None:
            iface.ip = peer
            session.add(iface)
    events.record(session, ACTOR, "node.booted", node.name, f"called back from {peer or 'unknown'} ({mac})")
    session.flush()
    return node, secret


# ---- discovery and assignment -------------------------------------------------------------------------


def discovered_name(mac: str) -> str:
    return DISCOVERED_PREFIX + mac.replace(":", "")


def discover(
    session: Session, settings: Settings, report: DiscoveryReport, peer: str | None
) -> DiscoveryAccepted:
    """Record what an unknown machine found about itself; it appears as ``discovered``.

    Anyone on the provisioning network may post, so what one post stores is bounded: its facts in bytes
    (``max_facts_bytes``), the discovered machines in number and in bytes of facts (``max_discovered``,
    ``max_discovered_bytes``), and the names a category's rule hands out to machines that never went
    further (``max_rule_registered``). A refusal is one event per client a minute, the rest summed.
    """
    facts = report.facts.model_dump(mode="json")
    size = len(json.dumps(facts))  # the JSON text the database is given
    limits = settings.pxe
    if size > limits.max_facts_bytes:
        _refuse_discovery(
            session, report.mac, peer, f"{size} bytes of facts (limit {limits.max_facts_bytes})"
        )
        raise InvalidInput(
            f"facts: {size} bytes, more than the {limits.max_facts_bytes} one machine may store"
            " (BCM_PXE__MAX_FACTS_BYTES)",
            field="facts",
        )
    node = node_by_mac(session, report.mac)
    if node is not None and node.provision_state != State.DISCOVERED.value:
        return DiscoveryAccepted(node=node.name, state=node.provision_state, assigned=True)
    stored = _discovered_bytes(session, but=node.id if node is not None else None)
    if stored + size > limits.max_discovered_bytes:
        _refuse_discovery(
            session,
            report.mac,
            peer,
            f"discovered machines' facts would exceed {limits.max_discovered_bytes} bytes",
        )
        raise Conflict(
            f"discovered machines' facts hold {stored} bytes (limit {limits.max_discovered_bytes}, "
            "BCM_PXE__MAX_DISCOVERED_BYTES); assign or remove some (bcm node discovered)"
        )
    if node is None:
        waiting = session.exec(
            select(func.count()).select_from(Node).where(Node.provision_state == State.DISCOVERED.value)
        ).one()
        if waiting >= limits.max_discovered:
            _refuse_discovery(session, report.mac, peer, "too many discovered machines")
            raise Conflict(
                f"{waiting} discovered machines wait to be assigned (limit {limits.max_discovered}); "
                "assign or remove some (bcm node discovered)"
            )
        rule = _rule_for(session, report.mac)
        name, state, category_id = discovered_name(report.mac), State.DISCOVERED.value, None
        if rule is not None:
            free, held = _free_name(session, rule)
            # not refusals: the machine is stored as discovered (counted by max_discovered) with this event
            if free is None:
                events.record(
                    session,
                    ACTOR,
                    "node.discovered",
                    report.mac,
                    f"category {rule.name}: no free name left in {rule.discover_names}",
                    severity="warning",
                )
            elif held >= limits.max_rule_registered:
                # a flood of machines with the rule's MAC prefix must not take every name: beyond the limit
                # they wait as discovered, and the rule hands out names again as its machines provision
                events.record(
                    session,
                    ACTOR,
                    "node.discovered",
                    report.mac,
                    f"category {rule.name}: {held} machines hold its rule's names and were never "
                    f"provisioned (limit {limits.max_rule_registered}); left discovered",
                    severity="warning",
                )
            else:
                name, state, category_id = free, State.REGISTERED.value, rule.id
        node = Node(name=name, provision_state=state, category_id=category_id)
        session.add(node)
        session.flush()
        assert node.id is not None
        session.add(
            Interface(node_id=node.id, name=_boot_nic(report.facts, report.mac), mac=report.mac, boot=True)
        )
        how = f" (category {rule.name}'s rule)" if category_id is not None and rule is not None else ""
        events.record(
            session, ACTOR, "node.discovered", node.name, f"{report.mac} from {peer or 'unknown'}{how}"
        )
        if category_id is not None and rule is not None:
            node.facts, node.updated_at = facts, utcnow()
            session.add(node)
            session.flush()
            provisioning = zero_touch(session, settings, node, rule, report.bmc)
            return DiscoveryAccepted(
                node=node.name, state=node.provision_state, assigned=True, provisioning=provisioning
            )
    node.facts = facts
    node.updated_at = utcnow()
    session.add(node)
    session.flush()
    return DiscoveryAccepted(node=node.name, state=node.provision_state)


def zero_touch(
    session: Session, settings: Settings, node: Node, rule: Category, bmc: DiscoveredBmc | None
) -> bool:
    """A machine its category's rule just registered: take the BMC it reported, and provision it at once
    where the category says so (``auto_provision``) and its BMC is usable. True when it was queued.

    The report is unauthenticated, so a reported BMC is taken only when no other node has it (a machine
    must not make bcm power-cycle someone else's node), and the category's password goes to it only inside
    the range an admin set with that password (``bmc_discover_range``).
    """
    from bcm.services import power as power_svc

    if bmc is not None:
        why = _bmc_taken(session, node, bmc)
        if why:
            events.record(
                session,
                ACTOR,
                "node.bmc",
                node.name,
                f"reported BMC {bmc.protocol} {bmc.address} not taken: {why}",
                severity="warning",
            )
        else:
            node.bmc_address, node.bmc_protocol = bmc.address, bmc.protocol
            session.add(node)
            target = target_key(BmcProtocol(bmc.protocol), parse_bmc_address(bmc.address))
            bound = in_password_range(rule, bmc.address)
            if bound:
                rule.bmc_password_targets = {**(rule.bmc_password_targets or {}), node.name: target}
                session.add(rule)
            how = f"; category {rule.name}'s BMC password bound to it" if bound else ""
            events.record(session, ACTOR, "node.bmc", node.name, f"BMC {target} reported at discovery{how}")
            session.flush()
    if not rule.auto_provision:
        return False
    missing = power_svc.load_targets(session, settings.state_dir, [node.name]).missing
    if node.name in missing:
        events.record(
            session,
            ACTOR,
            "node.provision",
            node.name,
            f"category {rule.name} provisions at once, but not this node: {missing[node.name]}",
            severity="warning",
        )
        return False
    nodes = node_svc.apply_verb(
        session,
        [node.name],
        Verb.PROVISION.value,
        ACTOR,
        f"zero-touch: category {rule.name} provisions the machines its rule registers",
    )
    queue(session, nodes)
    return True


def in_password_range(cat: Category, address: str) -> bool:
    """Whether the category's BMC password may go to a BMC at ``address`` that a discovery reported."""
    if not (cat.bmc_password_enc and cat.bmc_discover_range):
        return False
    try:
        host = ipaddress.ip_address(parse_bmc_address(address).host)
        return host in ipaddress.ip_network(cat.bmc_discover_range, strict=False)
    except (ValueError, InvalidInput):
        return False  # a host name is never inside a range


def _bmc_taken(session: Session, node: Node, bmc: DiscoveredBmc) -> str | None:
    """Why the reported BMC must not become this node's: another node has that BMC already."""
    host = parse_bmc_address(bmc.address).host
    target = target_key(BmcProtocol(bmc.protocol), parse_bmc_address(bmc.address))
    like = session.exec(
        select(Node)
        .where(col(Node.bmc_address).contains(host, autoescape=True), Node.id != node.id)
        .limit(100)
    ).all()
    from bcm.services import power as power_svc

    others = [n for n, t in power_svc.current_targets(session, list(like)).items() if t == target]
    return f"node {others[0]} has that BMC" if others else None


def _refuse_discovery(session: Session, mac: str, peer: str | None, why: str) -> None:
    """Record a refused discovery (one event per client a minute, the rest summed) and keep it."""
    events.record_unauthenticated(
        session, ACTOR, "node.discovered", mac, f"refused from {peer or 'unknown'}: {why}", source=peer
    )
    session.commit()


def _discovered_bytes(session: Session, but: int | None) -> int:
    """The bytes of facts the discovered machines hold (but one). PostgreSQL measures what it stores (a large
    value compressed) without reading it back; SQLite the JSON text."""
    bind = session.get_bind()
    size = func.pg_column_size(Node.facts) if bind.dialect.name == "postgresql" else func.length(Node.facts)
    stmt = select(func.coalesce(func.sum(size), 0)).where(Node.provision_state == State.DISCOVERED.value)
    if but is not None:
        stmt = stmt.where(Node.id != but)
    return int(session.exec(stmt).one())


def _rule_for(session: Session, mac: str) -> Category | None:
    """The category whose discovery rule matches the MAC (the longest prefix wins)."""
    rules = session.exec(select(Category).where(col(Category.discover_mac_prefix).is_not(None))).all()
    matching = [c for c in rules if c.discover_names and mac.startswith(c.discover_mac_prefix or "-")]
    return max(matching, key=lambda c: (len(c.discover_mac_prefix or ""), c.name), default=None)


def _free_name(session: Session, rule: Category) -> tuple[str | None, int]:
    """The rule's first free name, and how many machines hold one without having gone further: registered
    in the rule's category with a boot MAC of its prefix, never provisioned nor inventoried."""
    from bcm.domain.naming import expand_hostlist

    pool = expand_hostlist(rule.discover_names or "", "discover_names")
    taken: set[str] = set()
    for i in range(0, len(pool), 500):
        taken |= set(session.exec(select(Node.name).where(col(Node.name).in_(pool[i : i + 500]))))
    held = session.exec(
        select(func.count(func.distinct(Node.id)))
        .join(Interface, col(Interface.node_id) == col(Node.id))
        .where(
            Node.category_id == rule.id,
            Node.provision_state == State.REGISTERED.value,
            col(Node.inventoried_at).is_(None),
            col(Interface.mac).startswith(rule.discover_mac_prefix or "-", autoescape=True),
        )
    ).one()
    return next((n for n in pool if n not in taken), None), int(held)


def _boot_nic(facts: HardwareFacts, mac: str) -> str:
    for nic in facts.nics:
        if nic.mac and nic.mac.lower() == mac and 1 <= len(nic.name) <= 15:
            return nic.name
    return "eth0"


def list_discovered(session: Session) -> list[Node]:
    return list(
        session.exec(
            select(Node).where(Node.provision_state == State.DISCOVERED.value).order_by(col(Node.name))
        )
    )


def assign(session: Session, req: AssignRequest, actor: str) -> Node:
    """A discovered machine gets its name, category and image and becomes ``registered``."""
    node = node_by_mac(session, req.mac)
    if node is None:
        raise NotFound(f"no machine with MAC {req.mac} was discovered (see `bcm node discovered`)")
    if node.provision_state != State.DISCOVERED.value:
        raise Conflict(
            f"{req.mac} is node {node.name}, {node.provision_state}: only discovered machines are assigned"
        )
    if (
        req.name != node.name
        and session.exec(select(Node.id).where(Node.name == req.name)).first() is not None
    ):
        raise Conflict(f"name: a node named {req.name} exists already", field="name")
    if req.category is not None:
        cat = session.exec(select(Category).where(Category.name == req.category)).first()
        if cat is None:
            raise InvalidInput(f"category: no category named {req.category!r}", field="category")
        node.category_id = cat.id
    if req.image is not None:
        image_svc.check_reference(session, req.image)
        node.image = req.image
    was = node.name
    node.name = req.name
    node.provision_state = next_state(node.name, node.provision_state, Verb.REGISTER).value
    node.updated_at = utcnow()
    session.add(node)
    events.record(session, actor, "node.assign", req.name, f"discovered {req.mac} ({was}) assigned")
    session.flush()
    return node


# ---- the per-node overlay -----------------------------------------------------------------------------


def ensure_host_key(session: Session, state_dir: Path, node: Node) -> str | None:
    """The node's pinned SSH host key at the start of an attempt. A pinned key is kept (bcm's own, or one an
    admin registered: only ``provision --rekey`` replaces it); bcm makes one only where none is pinned and
    the category leaves the key to bcm (``host_key_source node``: the node makes it, pinned at hello)."""
    if node.ssh_host_key or host_key_source(session, node) == "node":
        return node.ssh_host_key
    return node_svc.make_host_key(
        session, state_dir, node, ACTOR, "made by bcm for the node's first provision"
    )


def _add(
    tar: tarfile.TarFile,
    path: str,
    data: bytes | None,
    mode: int,
    kind: bytes = tarfile.REGTYPE,
    link: str = "",
) -> None:
    info = tarfile.TarInfo(path)
    info.mode, info.type, info.mtime, info.uname, info.gname = mode, kind, int(time.time()), "root", "root"
    if kind == tarfile.SYMTYPE:
        info.linkname = link
    if data is not None:
        info.size = len(data)
    tar.addfile(info, io.BytesIO(data) if data is not None else None)


def overlay(session: Session, settings: Settings, mac: str, token: str | None, peer: str | None) -> bytes:
    """The files only this node gets at boot, as one tar.gz the initramfs unpacks over the image; only to the
    address the boot is bound to, and, when it carries bcm's host private key, once per attempt."""
    node, row = check_boot_token(session, mac, token, peer)
    private = None
    if host_key_source(session, node) == "bcm" and node.host_key_enc and node.ssh_host_key:
        if row.overlay_at is not None:
            _refuse(
                session,
                mac,
                f"the overlay with the host key went out already ({row.overlay_at:%H:%M:%S} UTC)",
                peer,
                node.name,
            )
            raise Forbidden(
                "this boot's overlay was sent already; provision the node again for a new attempt"
            )
        private = secret_svc.decrypt(settings.state_dir, node.host_key_enc)
    pub = node.ssh_host_key
    head_key = (settings.ssh_key_file.with_suffix(".pub")).read_text().strip()
    hosts = session.exec(
        select(Node.name, Interface.ip)
        .join(Interface, col(Interface.node_id) == col(Node.id))
        .where(col(Interface.ip).is_not(None), Node.provision_state != State.DISCOVERED.value)
        .order_by(col(Node.name))
        .limit(10000)
    ).all()
    ca = tls.published_ca(settings) if settings.tls.enabled else None
    ctx: dict[str, Any] = {
        "node": node.name,
        "server_url": server_url(settings),
        "head": settings.pxe.address,
        "hosts": [(n, ip) for n, ip in hosts],
        "api_url": tls.node_api_url(settings),
        "ca_file": NODE_CA_PATH if ca else None,
    }
    buf = io.BytesIO()
    # gzip level 1: an overlay is made for every boot, and level 9 (tarfile's default) cost 4x the CPU for 7%
    # fewer bytes (0.82 ms against 0.20 ms for an /etc/hosts of 1,000 nodes, 4.6 KB against 5.0 KB)
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        for d in (
            "etc",
            "etc/ssh",
            "etc/ssh/sshd_config.d",
            "etc/bcm",
            "etc/systemd",
            "etc/systemd/system",
            "etc/systemd/system/multi-user.target.wants",
            "usr",
            "usr/local",
            "usr/local/sbin",
        ):
            _add(tar, d, None, 0o755, tarfile.DIRTYPE)
        _add(tar, "root", None, 0o700, tarfile.DIRTYPE)
        _add(tar, "root/.ssh", None, 0o700, tarfile.DIRTYPE)
        _add(tar, "etc/hostname", f"{node.name}\n".encode(), 0o644)
        _add(tar, "etc/hosts", render("overlay/etc/hosts.j2", **ctx).encode(), 0o644)
        if (
            private is not None
        ):  # else the node's sshd makes its own (pinned at hello, or an admin's pin kept)
            _add(tar, "etc/ssh/ssh_host_ed25519_key", private.encode(), 0o600)
            _add(tar, "etc/ssh/ssh_host_ed25519_key.pub", f"{pub} root@{node.name}\n".encode(), 0o644)
        _add(
            tar,
            "etc/ssh/sshd_config.d/bcm.conf",
            render("overlay/etc/ssh/sshd_config.d/bcm.conf.j2", **ctx).encode(),
            0o644,
        )
        _add(tar, "root/.ssh/authorized_keys", f"{head_key}\n".encode(), 0o600)
        _add(
            tar,
            "etc/bcm/node.json",
            json.dumps({"node": node.name, "server_url": ctx["server_url"], "mac": mac}).encode(),
            0o644,
        )
        if ca is not None:  # the CA the node's callback and agent verify the API against
            _add(tar, NODE_CA_PATH.lstrip("/"), ca.read_bytes(), 0o644)
        _add(
            tar,
            "usr/local/sbin/bcm-hello",
            render("overlay/usr/local/sbin/bcm-hello.j2", **ctx).encode(),
            0o755,
        )
        _add(
            tar,
            "etc/systemd/system/bcm-hello.service",
            render("overlay/etc/systemd/system/bcm-hello.service.j2", **ctx).encode(),
            0o644,
        )
        _add(
            tar,
            "etc/systemd/system/multi-user.target.wants/bcm-hello.service",
            None,
            0o777,
            tarfile.SYMTYPE,
            "/etc/systemd/system/bcm-hello.service",
        )
        # the agent, where the image carries it (a recipe with `agent: true`): starts with the traded token
        _add(
            tar,
            "etc/systemd/system/bcm-agent.service",
            render("overlay/etc/systemd/system/bcm-agent.service.j2", **ctx).encode(),
            0o644,
        )
        _add(
            tar,
            "etc/systemd/system/multi-user.target.wants/bcm-agent.service",
            None,
            0o777,
            tarfile.SYMTYPE,
            "/etc/systemd/system/bcm-agent.service",
        )
    row.overlay_at = utcnow()
    session.add(row)
    what = "with bcm's host key" if private is not None else "without a host key"
    events.record(session, ACTOR, "boot.overlay", node.name, f"overlay {what} sent to {peer} ({mac})")
    return buf.getvalue()


# ---- the provisioning queue ---------------------------------------------------------------------------


def fail(session: Session, node: Node, why: str) -> None:
    node.provision_state = next_state(node.name, node.provision_state, Verb.FAIL).value
    node.target_state = None
    node.last_error = why[:2000]
    node.provision_queued_at = node.provision_started_at = node.provision_deadline = None
    node.updated_at = utcnow()
    session.add(node)
    events.record(session, ACTOR, "node.provision", node.name, why, severity="error")


def queue(session: Session, nodes: list[Node]) -> None:
    """Nodes a provision/reimage verb moved to ``provisioning`` wait their turn (oldest first)."""
    now = utcnow()
    end_attempts(session, nodes)
    for n in nodes:
        n.target_state = State.BOOTED.value
        n.last_error = None
        n.provision_queued_at, n.provision_started_at, n.provision_deadline = now, None, None
        session.add(n)


def timed_out(session: Session, now: datetime) -> list[str]:
    """Provisioning nodes past their deadline fail (a server that was down fails them at its next start)."""
    late = session.exec(
        select(Node).where(
            Node.provision_state == State.PROVISIONING.value, col(Node.provision_deadline) < now
        )
    ).all()
    for n in late:
        fail(
            session,
            n,
            "provisioning: the node did not call back before its deadline "
            f"({n.provision_deadline:%Y-%m-%d %H:%M:%S} UTC); check its console",
        )
    return [n.name for n in late]


def claim(session: Session, settings: Settings, now: datetime) -> list[str]:
    """Start the next queued nodes, so that at most ``pxe.max_concurrent`` provision at once."""
    in_flight = session.exec(
        select(func.count())
        .select_from(Node)
        .where(Node.provision_state == State.PROVISIONING.value, col(Node.provision_started_at).is_not(None))
    ).one()
    room = settings.pxe.max_concurrent - in_flight
    if room <= 0:
        return []
    nodes = session.exec(
        select(Node)
        .where(
            Node.provision_state == State.PROVISIONING.value,
            col(Node.provision_started_at).is_(None),
            col(Node.lock_owner).is_(None) | (col(Node.lock_expires) < now),
        )
        .order_by(col(Node.provision_queued_at), col(Node.id))
        .limit(room)
    ).all()
    deadline = now + timedelta(seconds=settings.pxe.provision_timeout_s)
    for n in nodes:
        n.provision_queued_at = n.provision_queued_at or now
        n.provision_started_at, n.provision_deadline = now, deadline
        ensure_host_key(session, settings.state_dir, n)
        session.add(n)
    return [n.name for n in nodes]


# ---- dnsmasq host entries -----------------------------------------------------------------------------


def host_entries(session: Session) -> list[tuple[str, str | None, str]]:
    """(mac, ip, name) of every known machine's boot interface (discovered ones get no fixed entry)."""
    rows = session.exec(
        select(Interface.mac, Interface.ip, Node.name)
        .join(Node, col(Node.id) == col(Interface.node_id))
        .where(
            col(Interface.mac).is_not(None),
            col(Interface.boot),
            Node.provision_state != State.DISCOVERED.value,
        )
        .order_by(col(Interface.mac))
    ).all()
    return [(normalize_mac(m), ip, name) for m, ip, name in rows if m]
