"""Who this server process is: one id, made once per process, recorded on what it holds.

Operations record it as their lease owner (``Operation.owner``); leader election and ``bcm ha status``
name servers by it. ``host:pid:random``: the host and pid say where to look, the random part tells a
restarted process (same pid after a reboot or in a container) from its earlier life.
"""

from __future__ import annotations

import os
import socket
import uuid

_ID = f"{socket.gethostname()[:64]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def server_id() -> str:
    """This process's server id (at most 128 characters, stable for the life of the process)."""
    return _ID


def parse(server: str | None) -> tuple[str, int | None]:
    """(host, pid) of a server id; pid None when the id is not one of ours."""
    host, _, rest = (server or "").partition(":")
    pid = rest.partition(":")[0]
    return host, int(pid) if pid.isdigit() else None


def dead_here(server: str | None) -> bool:
    """A server of this host whose process is gone, or this process's earlier life (same pid)."""
    host, pid = parse(server)
    if host != socket.gethostname()[:64] or pid is None:
        return False
    if pid == os.getpid():
        return server != _ID
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
