"""/api/v1/discovered: machines that PXE-booted the discovery image and wait for an admin to accept them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from sqlmodel import col, select

from bcm.api.deps import Operator, SessionDep, Viewer, actor
from bcm.domain.facts import NVIDIA_PCI_VENDOR_ID
from bcm.models.node import Interface, Node, NodePublic
from bcm.models.pxe import AssignRequest, DiscoveredPublic
from bcm.services import nodes as node_svc
from bcm.services import pxe as svc

router = APIRouter(prefix="/discovered", tags=["nodes"])


def _public(node: Node, mac: str | None) -> DiscoveredPublic:
    facts: dict[str, Any] = node.facts or {}
    cpu = facts.get("cpu") or {}
    pci = facts.get("pci_devices") or []
    return DiscoveredPublic(
        name=node.name,
        mac=mac,
        cpu_model=cpu.get("model"),
        threads=cpu.get("threads"),
        memory_bytes=facts.get("memory_bytes"),
        disks=len(facts.get("disks") or []),
        nvidia_pci_devices=sum(1 for d in pci if d.get("vendor_id") == NVIDIA_PCI_VENDOR_ID),
        product=(facts.get("dmi") or {}).get("product_name"),
        discovered_at=node.created_at,
        updated_at=node.updated_at,
    )


@router.get("", response_model=list[DiscoveredPublic])
def list_discovered(session: SessionDep, _t: Viewer) -> list[DiscoveredPublic]:
    """Machines seen by PXE discovery and not yet assigned, with what they reported."""
    nodes = svc.list_discovered(session)
    macs = {
        i.node_id: i.mac
        for i in session.exec(select(Interface).where(col(Interface.node_id).in_([n.id for n in nodes])))
    }
    return [_public(n, macs.get(n.id or 0)) for n in nodes]


@router.post("/assign", response_model=NodePublic)
def assign(body: AssignRequest, session: SessionDep, token: Operator) -> NodePublic:
    """Accept a discovered machine: name it, give it a category and image; it becomes registered."""
    node = svc.assign(session, body, actor(token))
    session.commit()
    return node_svc.to_public(session, [node])[0]
