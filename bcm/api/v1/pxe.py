"""/api/v1/pxe: the PXE service of this head node (dnsmasq's DHCP/TFTP and the boot scripts)."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request

from bcm.api.deps import Admin, Viewer, actor
from bcm.db import session_scope
from bcm.models.pxe import PxeConfigUpdate, PxeStatus
from bcm.services import pxe as svc
from bcm.settings import PxeSettings
from bcm.workers import provision

router = APIRouter(prefix="/pxe", tags=["pxe"])


def _status(request: Request, source: str) -> PxeStatus:
    settings = request.app.state.settings
    p = settings.pxe
    dhcp = getattr(request.app.state, "dhcp", None)
    return PxeStatus(
        enabled=p.enabled,
        source=source,
        interface=p.interface,
        address=p.address,
        mode=p.mode,
        range_start=p.range_start,
        range_end=p.range_end,
        netmask=p.netmask,
        router=p.router,
        server_url=svc.server_url(settings),
        dnsmasq_pid=dhcp.pid if dhcp else None,
        dnsmasq_restarts=dhcp.restarts if dhcp else 0,
    )


def _source(request: Request) -> str:
    with session_scope(request.app.state.engine) as s:
        return "api" if svc.stored_config(s) is not None else "settings"


@router.get("", response_model=PxeStatus)
async def show(request: Request, _t: Viewer) -> PxeStatus:
    """What PXE serves now, and whether dnsmasq runs."""
    return _status(request, await anyio.to_thread.run_sync(_source, request))


@router.put("", response_model=PxeStatus)
async def configure(body: PxeConfigUpdate, request: Request, token: Admin) -> PxeStatus:
    """Enable (or change, or disable) PXE; dnsmasq checks the config first, then restarts with it."""
    engine, settings = request.app.state.engine, request.app.state.settings
    who = actor(token)

    def store() -> PxeSettings:
        with session_scope(engine) as s:
            return svc.update_config(s, settings, body, who)

    settings.pxe = await anyio.to_thread.run_sync(store)  # committed: now serve it
    await provision.reconfigure(request.app)
    renew = getattr(request.app.state, "tls_renew", None)
    if renew is not None:  # TLS with bcm's CA: the certificate names the new PXE address from now on
        await renew()
    return _status(request, "api")
