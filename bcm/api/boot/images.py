"""/boot/v1/images/{name}/{version}/{file}: artifacts for network boot (no token; images hold no secrets).

Served with ``Range`` and ``ETag`` (the artifact's sha256), at most ``images.max_transfers`` at once
and ``images.max_transfers_per_client`` from one client address (more get a 503 with Retry-After); a
download slower than ``images.min_rate_bytes_s`` over ``images.min_rate_window_s`` is dropped, so slow
readers cannot hold every slot. An artifact whose file is missing or not the size recorded at publish
is never sent: a 404 or 500 and an event, so a half-written file is not presented as whole.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import pathlib
import threading
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Path, Request
from fastapi.responses import FileResponse, Response
from starlette.datastructures import MutableHeaders

from bcm.api.params import Name
from bcm.db import session_scope
from bcm.errors import BcmError, NotFound, Unavailable
from bcm.pathsend import RANGE_EXTENSION, RateFloor, SlowReader
from bcm.services import events
from bcm.services import images as svc
from bcm.settings import Settings

router = APIRouter(prefix="/boot/v1/images", tags=["boot"])
# artifact downloads this process started, by kind (kernel, initramfs, rootfs): bcm_boot_artifact_fetches_total
FETCHES: collections.Counter[str] = collections.Counter()
# bytes of `auto` install deltas sent (#30: what crosses the wire for a sync): bcm_image_delta_bytes_total
DELTA_BYTES = [0]
Version = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")]
Filename = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]


class ArtifactCorrupt(BcmError):
    status_code = 500


log = logging.getLogger("bcm.boot")


class Transfers:
    """Artifact downloads in flight, bounded in all and per client address."""

    def __init__(self, limit: int, per_client: int | None = None) -> None:
        self.limit, self.active, self._lock = limit, 0, threading.Lock()
        self.per_client = per_client or limit
        self.by_client: dict[str, int] = {}

    def enter(self, client: str = "unknown") -> None:
        with self._lock:
            if self.active >= self.limit:
                raise Unavailable(f"{self.limit} image downloads in flight; try again", retry_after=2)
            if self.by_client.get(client, 0) >= self.per_client:
                raise Unavailable(
                    f"{client} already has {self.per_client} image downloads in flight; try again "
                    "when one ends",
                    retry_after=2,
                )
            self.active += 1
            self.by_client[client] = self.by_client.get(client, 0) + 1

    def leave(self, client: str = "unknown") -> None:
        with self._lock:
            self.active -= 1
            left = self.by_client.get(client, 1) - 1
            if left > 0:
                self.by_client[client] = left
            else:
                self.by_client.pop(client, None)


class CountedFile(FileResponse):
    """A FileResponse that gives its transfer slot back when it is done, sent or not.

    Under ``bcm serve`` a whole file, and the 206 of a single range, go by ``sendfile(2)`` (``bcm.pathsend``);
    where the server offers no ``pathsend`` (the test client), and for several ranges at once (a multipart
    body), root images of hundreds of MiB are read 4 MiB at a time (Starlette's default is 64 KiB).
    bench/boot.py and bench/boot_storm.py measure it against nginx.
    """

    chunk_size = 4 * 1024 * 1024

    def __init__(
        self,
        *args: object,
        transfers: Transfers,
        client: str = "unknown",
        min_rate: tuple[int, float] = (0, 30.0),
        **kwargs: object,
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._transfers, self._client, self._min_rate = transfers, client, min_rate
        self._range_by_pathsend = False

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        held = True

        def give_back() -> None:
            nonlocal held
            if held:
                held = False
                self._transfers.leave(self._client)

        async def send_then_give_back(message: Any) -> None:
            # the slot comes back as the last byte is handed over, before this task winds down: a client's
            # next request on the same connection must not find its own finished download still counted
            await send(message)
            kind = message.get("type")
            if kind == "http.response.pathsend" or (
                kind == "http.response.body" and not message.get("more_body")
            ):
                give_back()

        try:
            self._range_by_pathsend = RANGE_EXTENSION in scope.get("extensions", {})
            outer = send_then_give_back
            if self._min_rate[0] > 0:
                outer = held_to_a_floor(outer, RateFloor(*self._min_rate))
            await super().__call__(scope, receive, outer)
        except SlowReader as exc:  # the response is incomplete: the server closes the connection
            log.info("boot artifact download by %s dropped: %s", self._client, exc)
        finally:
            give_back()

    async def _handle_single_range(
        self,
        send,
        start: int,
        end: int,
        file_size: int,  # type: ignore[no-untyped-def]
        send_header_only: bool,
    ) -> None:
        if send_header_only or not self._range_by_pathsend:
            await super()._handle_single_range(send, start, end, file_size, send_header_only)
            return
        headers = MutableHeaders(raw=list(self.raw_headers))
        headers["content-range"] = f"bytes {start}-{end - 1}/{file_size}"
        headers["content-length"] = str(end - start)
        await send({"type": "http.response.start", "status": 206, "headers": headers.raw})
        await send({"type": "http.response.pathsend", "path": str(self.path), "offset": start})


def held_to_a_floor(send: Any, floor: RateFloor) -> Any:
    """``send`` for a body sent in chunks (a Range, a server without pathsend): each chunk must be taken
    by the client while the window's minimum is still reachable, or :class:`SlowReader` ends the download
    (a whole file by pathsend is judged in :func:`bcm.pathsend._sendfile_all`)."""

    async def send_with_floor(message: Any) -> None:
        if message.get("type") != "http.response.body":
            await send(message)
            return
        task = asyncio.ensure_future(send(message))
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=floor.left())
                if not task.done():
                    floor.judge()
        except BaseException:
            task.cancel()
            raise
        await task
        floor.moved_bytes(len(message.get("body", b"")))

    return send_with_floor


def transfer_limit(settings: Settings) -> int:
    """``images.max_transfers``, or where unset as many as ``pxe.max_concurrent`` (at least 64)."""
    return settings.images.max_transfers or max(64, settings.pxe.max_concurrent)


def _transfers(request: Request) -> Transfers:
    state = request.app.state
    if getattr(state, "image_transfers", None) is None:
        settings = state.settings
        state.image_transfers = Transfers(transfer_limit(settings), settings.images.max_transfers_per_client)
    return state.image_transfers  # type: ignore[no-any-return]


@router.api_route("/{name}/{version}/{filename}", methods=["GET", "HEAD"], response_class=Response)
async def artifact(name: Name, version: Version, filename: Filename, request: Request) -> Response:
    """The artifact's bytes (``Range``: one range or several; a range past the end: 416). The transfer limits
    come first: a refused download (503 + Retry-After) costs no database read and no ``stat``."""
    transfers = _transfers(request)
    client = request.client.host if request.client else "unknown"
    transfers.enter(client)
    try:
        path, stat, sha256, kind = await anyio.to_thread.run_sync(
            _checked_file, request.app.state, name, version, filename
        )
    except BaseException:
        transfers.leave(client)
        raise
    if request.method == "GET":
        FETCHES[kind] += 1  # /metrics: a node booted from its disk fetches none (#30)
    conf = request.app.state.settings.images
    return CountedFile(
        path,
        transfers=transfers,
        client=client,
        min_rate=(conf.min_rate_bytes_s, conf.min_rate_window_s),
        media_type="application/octet-stream",
        headers={"ETag": f'"{sha256}"', "Cache-Control": "no-cache"},
        stat_result=stat,
    )


def _checked_file(
    state: Any, name: str, version: str, filename: str
) -> tuple[pathlib.Path, os.stat_result, str, str]:
    """The artifact's file, its ``stat``, sha256 and kind; a file missing or not its published size is never sent."""
    images_dir = state.settings.images_dir
    with session_scope(state.engine) as session:
        image, art = svc.find_artifact(session, name, version, filename)
        path = svc.version_dir(images_dir, image.name, image.version) / art.filename
        try:
            stat = path.stat()
        except FileNotFoundError:
            stat = None
        if stat is not None and stat.st_size == art.size:
            return path, stat, art.sha256, art.kind
        problem = "file missing" if stat is None else f"size {stat.st_size} != {art.size} recorded at publish"
        events.record(
            session, "bcm:boot", "image.artifact", f"{name}:{version}/{filename}", problem, severity="error"
        )
    if stat is None:
        raise NotFound(f"image {name} version {version}: {filename} is missing on the server")
    raise ArtifactCorrupt(f"image {name} version {version}: {filename} does not match its published size")
