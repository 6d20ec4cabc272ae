"""This server process's identity: ``hostname:pid:random hex``, made once and stable for the process.

Recorded on the rows a server owns (its ``server`` row, the leader lease, operations it holds), so
another server can tell whose they are and whether that process is still the one that wrote them.
"""

from __future__ import annotations

import os
import socket
import uuid
from functools import lru_cache


@lru_cache(maxsize=1)
def server_id() -> str:
    """``hostname:pid:random hex`` for this process (the same on every call)."""
    return f"{socket.gethostname()[:64]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
