"""/boot/v1/images/{name}/{version}/{file}: artifacts for network boot (no token; images hold no secrets).

Served with ``Range`` and ``ETag`` (the artifact's sha256), at most ``images.max_transfers`` at once
(more get a 503 with Retry-After). An artifact whose file is missing or not the size recorded at publish
is never sent: a 404 or 500 and an event, so a half-written file is not presented as whole.
"""

from __future__ import annotations

import threading
from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import FileResponse, Response

from bcm.api.deps import SessionDep
from bcm.api.params import Name
from bcm.errors import BcmError, NotFound, Unavailable
from bcm.services import events
from bcm.services import images as svc

router = APIRouter(prefix="/boot/v1/images", tags=["boot"])
Version = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")]
Filename = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]


class ArtifactCorrupt(BcmError):
    status_code = 500


class Transfers:
    """A count of artifact downloads in flight, bounded."""

    def __init__(self, limit: int) -> None:
        self.limit, self.active, self._lock = limit, 0, threading.Lock()

    def enter(self) -> None:
        with self._lock:
            if self.active >= self.limit:
                raise Unavailable(f"{self.limit} image downloads in flight; try again", retry_after=2)
            self.active += 1

    def leave(self) -> None:
        with self._lock:
            self.active -= 1


class CountedFile(FileResponse):
    """A FileResponse that gives its transfer slot back when it is done, sent or not.

    Under ``bcm serve`` a whole file goes by ``sendfile(2)`` (``bcm.pathsend``); where the server offers no
    ``pathsend`` (the test client, a Range request), root images of hundreds of MiB are read 4 MiB at a
    time (Starlette's default is 64 KiB). bench/boot.py measures it against nginx.
    """

    chunk_size = 4 * 1024 * 1024

    def __init__(self, *args: object, transfers: Transfers, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._transfers = transfers

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._transfers.leave()


def _transfers(request: Request) -> Transfers:
    state = request.app.state
    if getattr(state, "image_transfers", None) is None:
        state.image_transfers = Transfers(state.settings.images.max_transfers)
    return state.image_transfers  # type: ignore[no-any-return]


@router.api_route("/{name}/{version}/{filename}", methods=["GET", "HEAD"], response_class=Response)
def artifact(name: Name, version: Version, filename: Filename, request: Request, session: SessionDep) -> Response:
    image, art = svc.find_artifact(session, name, version, filename)
    path, problem = svc.artifact_problem(request.app.state.settings.images_dir, image, art)
    if problem == "missing":
        events.record(session, "bcm:boot", "image.artifact", f"{name}:{version}/{filename}", "file missing",
                      severity="error")  # fmt: skip
        session.commit()
        raise NotFound(f"image {name} version {version}: {filename} is missing on the server")
    if problem == "size":
        events.record(session, "bcm:boot", "image.artifact", f"{name}:{version}/{filename}",
                      f"size {path.stat().st_size} != {art.size} recorded at publish", severity="error")  # fmt: skip
        session.commit()
        raise ArtifactCorrupt(f"image {name} version {version}: {filename} does not match its published size")
    transfers = _transfers(request)
    transfers.enter()
    return CountedFile(
        path,
        transfers=transfers,
        media_type="application/octet-stream",
        headers={"ETag": f'"{art.sha256}"', "Cache-Control": "no-cache"},
    )
