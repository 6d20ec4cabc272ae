"""Node-facing PXE endpoints (no admin token; nothing here answers a secret without a one-time boot token).

- ``GET /boot/v1/ipxe/boot.ipxe``: the script dnsmasq hands to every iPXE client; it chains to
- ``GET /boot/v1/ipxe/{mac}``: the script for that machine's purpose (discovery, image, local, noimage);
- ``POST /boot/v1/discover``: the discovery image reports a machine's facts;
- ``GET /boot/v1/overlay/{mac}``: the node's own files (host key, hostname, hosts, callback), with its
  one-time boot token as the bearer token, only from the address the boot is bound to;
- ``POST /boot/v1/hello``: the booted node trades that token for its agent token (once, from that address);
- ``POST /boot/v1/failed``: the image's init could not boot: with that token, the node fails at once;
- ``GET /boot/v1/ca.pem``: bcm's API CA certificate while TLS is on (public; ``bcm ca fetch`` checks its
  fingerprint before trusting it);
- ``GET /boot/v1/install/{mac}``: the init's install plan (with that token; the disk is installing from then);
- ``POST /boot/v1/installed``: the init installed and synced the disk (with that token);
- ``POST /boot/v1/hello/disk``: a system booted from its disk calls back with its agent token.

The client address is the socket's (``request.client``), never a header. A failed boot-token check is
counted against the client (``auth_failures``: a 429 once over the limit); a valid token is checked first
and never braked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import anyio
from fastapi import APIRouter, Depends, Path, Request, status
from fastapi.responses import FileResponse, PlainTextResponse, Response
from pydantic import ValidationError

from bcm.api.boot.agent import bearer_present, capped_body
from bcm.api.deps import bearer
from bcm.db import session_scope
from bcm.domain.naming import normalize_mac
from bcm.drivers import dnsmasq
from bcm.errors import Conflict, Forbidden, InvalidInput, NotFound, Unauthorized
from bcm.models.pxe import (
    BootFailure,
    DiscoveryAccepted,
    DiscoveryReport,
    DiskHello,
    HelloAnswer,
    HelloRequest,
    InstallDone,
)
from bcm.services import events
from bcm.services import install as install_svc
from bcm.services import pxe as svc

router = APIRouter(prefix="/boot/v1", tags=["boot"])
MacPath = Annotated[
    str,
    Path(
        min_length=12,
        max_length=17,
        pattern=r"^[0-9A-Fa-f]{2}([:-]?[0-9A-Fa-f]{2}){5}$",
        description="the MAC the machine booted from (52:54:00:00:00:01 or 52-54-00-00-00-01)",
    ),
]
IPXE = "text/plain; charset=utf-8"
T = TypeVar("T")


def _peer(request: Request) -> str | None:
    return request.client.host if request.client else None


SCRIPT: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/plain": {}}, "description": "an iPXE script"}
}


@router.get("/ca.pem", response_class=Response, responses={200: {"content": {"application/x-pem-file": {}}}})
def ca_certificate(request: Request) -> Response:
    """The CA certificate the API's certificate chains to (404 while TLS is off or the CA is the admin's own)."""
    pem: bytes | None = getattr(request.app.state, "ca_pem", None)
    if pem is None:
        raise NotFound("no CA is published here: the API does not speak TLS with a CA bcm knows")
    return Response(pem, media_type="application/x-pem-file", headers={"Cache-Control": "no-store"})


@router.get("/ipxe/boot.ipxe", response_class=Response, responses=SCRIPT)
def entry(request: Request) -> PlainTextResponse:
    """The first script: chain to the one for the booting MAC."""
    return PlainTextResponse(svc.entry_script(request.app.state.settings), media_type=IPXE)


@router.get("/ipxe/{mac}", response_class=Response, responses=SCRIPT)
async def ipxe_script(mac: MacPath, request: Request) -> PlainTextResponse:
    """The iPXE script for this machine's purpose (an unknown MAC gets discovery)."""
    address = normalize_mac(mac)
    engine, settings = request.app.state.engine, request.app.state.settings

    dhcp = getattr(request.app.state, "dhcp", None)
    # with bcm's own DHCP, a script that carries a boot token goes only to the address leased to that MAC
    leased = (
        dnsmasq.leased_addresses(dhcp.paths.leases, address) if dhcp and settings.pxe.mode == "dhcp" else ()
    )
    peer = _peer(request)

    def work() -> svc.BootScript:
        with session_scope(engine) as session:
            return svc.boot_script(
                session,
                settings,
                address,
                peer=peer,
                leased=leased,
                check_lease=dhcp is not None and settings.pxe.mode == "dhcp",
            )

    script = await anyio.to_thread.run_sync(work)
    return PlainTextResponse(
        script.text, media_type=IPXE, headers={"X-Bcm-Purpose": script.purpose, "Cache-Control": "no-store"}
    )


@router.post("/discover", response_model=DiscoveryAccepted, status_code=status.HTTP_202_ACCEPTED)
async def discover(request: Request) -> DiscoveryAccepted:
    """A machine booted into the discovery image posts its MAC and facts; it appears as discovered."""
    body = await capped_body(request)
    try:
        report = DiscoveryReport.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid report"}
        field = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise InvalidInput(
            f"{field}: {str(first.get('msg', 'invalid')).removeprefix('Value error, ')}", field=field
        ) from None
    engine, settings = request.app.state.engine, request.app.state.settings

    def work() -> DiscoveryAccepted:
        with session_scope(engine) as session:
            return svc.discover(session, settings, report, _peer(request))

    accepted = await anyio.to_thread.run_sync(work)
    await _sync_dnsmasq(request)
    if accepted.provisioning:  # zero-touch: queued in that transaction; the provisioner powers it on
        provisioner = getattr(getattr(request.app.state, "runner", None), "provisioner", None)
        if provisioner is not None:
            provisioner.wake()
    return accepted


@router.get(
    "/overlay/{mac}",
    response_class=Response,
    responses={200: {"content": {"application/gzip": {}}}},
    dependencies=[Depends(bearer_present)],
)
async def overlay(mac: MacPath, request: Request) -> Response:
    """The node's overlay (tar.gz), for the holder of its current one-time boot token only."""
    address = normalize_mac(mac)
    engine, settings = request.app.state.engine, request.app.state.settings
    token = bearer(request)

    peer = _peer(request)

    def work() -> bytes:
        with session_scope(engine) as session:
            return svc.overlay(session, settings, address, token, peer)

    data = await _braked(request, peer, work)
    return Response(data, media_type="application/gzip", headers={"Cache-Control": "no-store"})


@router.post("/failed", dependencies=[Depends(bearer_present)])
async def boot_failed(body: BootFailure, request: Request) -> dict[str, str]:
    """The image's init could not boot: with the attempt's one-time token, the node fails at once."""
    engine = request.app.state.engine
    token = bearer(request)
    peer = _peer(request)

    def work() -> dict[str, str]:
        with session_scope(engine) as session:
            node = svc.boot_failed(session, body.mac, token, peer, body.message)
            return {"node": node.name, "state": node.provision_state}

    answer = await _braked(request, peer, work)
    await _sync_dnsmasq(request)
    return answer


@router.post("/hello", response_model=HelloAnswer, dependencies=[Depends(bearer_present)])
async def hello(body: HelloRequest, request: Request) -> HelloAnswer:
    """The booted node's callback: its one-time token (bearer) becomes its agent token; → booted."""
    engine = request.app.state.engine
    token = bearer(request)

    peer = _peer(request)

    def work() -> HelloAnswer:
        with session_scope(engine) as session:
            node, secret = svc.hello(session, body.mac, token, peer, body.host_key)
            return HelloAnswer(node=node.name, state=node.provision_state, agent_token=secret)

    answer = await _braked(request, peer, work)
    provisioner = getattr(request.app.state, "provisioner", None)
    if provisioner is not None:
        provisioner.booted(answer.node)
    await _sync_dnsmasq(request)
    return answer


@router.get(
    "/install/{mac}", response_class=Response, responses=SCRIPT, dependencies=[Depends(bearer_present)]
)
async def install_plan(mac: MacPath, request: Request) -> PlainTextResponse:
    """The install plan (a shell script the image's init sources), for the holder of the boot's token only."""
    address = normalize_mac(mac)
    engine, settings = request.app.state.engine, request.app.state.settings
    token, peer = bearer(request), _peer(request)

    def work() -> str:
        with session_scope(engine) as session:
            node, _ = svc.check_boot_token(session, address, token, peer)
            return install_svc.plan_script(session, settings, node, address)

    text = await _braked(request, peer, work)
    return PlainTextResponse(
        text, media_type="text/plain; charset=utf-8", headers={"Cache-Control": "no-store"}
    )


@router.get(
    "/install/{mac}/delta",
    response_class=Response,
    responses={
        200: {"content": {"application/gzip": {}}},
        409: {"description": "no delta: sync from the root image"},
    },
    dependencies=[Depends(bearer_present)],
)
async def install_delta(mac: MacPath, request: Request) -> Response:
    """An `auto` install's changes since the version on the node's disk (a gzip'd tar and the paths to remove),
    for the holder of the boot's token only; built once per pair of versions and layout, off the request path."""
    from bcm.api.boot.images import DELTA_BYTES, FETCHES
    from bcm.drivers.imagedelta import DeltaError
    from bcm.workers.deltas import DeltaJob, Deltas

    address = normalize_mac(mac)
    engine, settings = request.app.state.engine, request.app.state.settings
    token, peer = bearer(request), _peer(request)

    def work() -> tuple[str, DeltaJob]:
        with session_scope(engine) as session:
            node, _ = svc.check_boot_token(session, address, token, peer)
            src = install_svc.delta_for(session, settings, node)
            what = f"{src.from_image} → {src.to_image}"
            return node.name, DeltaJob(src.old_rootfs, src.new_rootfs, src.out, src.skip, what)

    name, job = await _braked(request, peer, work)
    if getattr(request.app.state, "deltas", None) is None:
        request.app.state.deltas = Deltas()
    try:
        delta = await request.app.state.deltas.get(job)
    except DeltaError as exc:
        why = str(exc)

        def note() -> None:
            with session_scope(engine) as session:
                events.record(
                    session,
                    install_svc.ACTOR,
                    "node.install",
                    name,
                    f"no delta {job.what}: {why}",
                    severity="warning",
                )

        await anyio.to_thread.run_sync(note)
        raise Conflict(f"no delta {job.what}: {why}") from None
    FETCHES["delta"] += 1
    DELTA_BYTES[0] += delta.size
    return FileResponse(delta.path, media_type="application/gzip", headers={"Cache-Control": "no-store"})


@router.post("/installed", dependencies=[Depends(bearer_present)])
async def installed(body: InstallDone, request: Request) -> dict[str, str]:
    """The init installed the image and synced the disk: it holds ``image`` from now (with the boot's token)."""
    engine = request.app.state.engine
    token, peer = bearer(request), _peer(request)

    def work() -> dict[str, str]:
        with session_scope(engine) as session:
            node, _ = svc.check_boot_token(session, body.mac, token, peer)
            install_svc.installed(session, node, body.image, body.layout, body.mode, body.bytes_written)
            return {"node": node.name, "install_state": "installed"}

    return await _braked(request, peer, work)


@router.post("/hello/disk", dependencies=[Depends(bearer_present)])
async def disk_hello(body: DiskHello, request: Request) -> dict[str, str]:
    """A system booted from its disk calls back with its agent token: a provisioning node is booted."""
    from datetime import timedelta

    from bcm.errors import BcmError
    from bcm.models.base import utcnow
    from bcm.services import auth

    engine = request.app.state.engine
    token, peer = bearer(request), _peer(request)

    def work() -> dict[str, str]:
        with session_scope(engine) as session:
            row = auth.node_tokens(session, [token or ""], utcnow() - timedelta(minutes=1))[token or ""]
            if isinstance(row, BcmError):
                raise row
            node = install_svc.disk_hello(session, row.node_id or 0, body.mac, peer)
            return {"node": node.name, "state": node.provision_state}

    answer = await _braked(request, peer, work)
    provisioner = getattr(request.app.state, "provisioner", None)
    if provisioner is not None:
        provisioner.booted(answer["node"])
    return answer


async def _braked(request: Request, peer: str | None, work: Callable[[], T]) -> T:
    """Run ``work``; a refused boot token counts against the client (429 once it is over the limit)."""
    try:
        return await anyio.to_thread.run_sync(work)
    except (Unauthorized, Forbidden) as exc:
        raise request.app.state.auth_failures.refusal(
            peer or "unknown", request.url.path, "boot token refused", exc
        ) from None


async def _sync_dnsmasq(request: Request) -> None:
    dhcp = getattr(request.app.state, "dhcp", None)
    if dhcp is not None:
        await dhcp.sync()
