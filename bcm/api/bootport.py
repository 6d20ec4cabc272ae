"""The plain-HTTP port while the API speaks TLS: the boot files that run before a node can trust anything.

iPXE and the boot image's init fetch scripts, artifacts and the overlay over plain HTTP (what they carry is
public or bound to a one-time boot token and the node's address), and ``bcm ca fetch`` may read the public
CA certificate here. Everything else, the admin API, the dashboard, ``/metrics`` and the calls that carry
or return an agent token (``/boot/v1/hello``, ``/boot/v1/agent/…``), answers 404 on this port: those go
over https, verified against the CA the node got in its overlay.
"""

from __future__ import annotations

import json
from typing import Any

from bcm.services.tls import CA_PATH

# exact paths, and prefixes ending in "/"
BOOT_ROUTES = (
    "/boot/v1/ipxe/",  # boot.ipxe and the script for each MAC
    "/boot/v1/images/",  # kernels, initramfs, root file systems (sha256 on the kernel command line)
    "/boot/v1/overlay/",  # the node's own files, for its one-time boot token only
    "/boot/v1/discover",  # the discovery image's facts (no secret in or out)
    "/boot/v1/failed",  # the image's init could not boot (one-time token)
    "/boot/v1/install/",  # the install-to-disk plan (one-time token; no secret in it)
    "/boot/v1/installed",  # the init installed the image to disk (one-time token)
    CA_PATH,  # the public CA certificate
)


def is_boot_route(path: str) -> bool:
    return any(path.startswith(r) if r.endswith("/") else path == r for r in BOOT_ROUTES)


class BootOnly:
    """ASGI: pass boot routes to ``app``; 404 for everything else (a JSON body that says where the API is)."""

    def __init__(self, app: Any, api_url: str) -> None:
        self.app = app
        self.body = json.dumps(
            {"error": "NotFound", "message": f"this port serves boot files only; the API is at {api_url}"}
        ).encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and is_boot_route(scope["path"]):
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # websockets: closed; lifespan is the API server's
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            return
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(self.body)).encode())]
        await send({"type": "http.response.start", "status": 404, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})
