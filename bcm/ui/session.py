"""Dashboard sessions: a cookie naming the signed-in token by id, with an expiry, signed with HMAC.

The cookie never holds the token itself: ``<token id>.<expires>.<nonce>.<hmac>``, the HMAC keyed by a key
derived from the state directory's ``secret.key`` (every server of one site shares it). Each request
reads the token row again, so a revoked token ends its sessions at once. Signing out puts the nonce on
a deny list kept until the cookie would have expired (in this process: a session signed out on one
server of several stays valid on the others until it expires, at most :data:`LIFETIME_S`).
CSRF tokens are HMACs of the session's nonce: a page's forms carry one, an action without it is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from bcm.services import secrets as secret_store

COOKIE = "bcm_session"
LOGIN_COOKIE = "bcm_signin"  # pre-session nonce: the sign-in form's own CSRF token is bound to it
LIFETIME_S = 8 * 3600
MAX_DENIED = 100_000


@lru_cache(maxsize=8)
def _key(state_dir: Path) -> bytes:
    base = secret_store._load_or_create(state_dir)  # the site's one secret; a derived key for sessions
    return hashlib.sha256(b"bcm-ui-session\x00" + base).digest()


def _mac(state_dir: Path, message: str) -> str:
    return hmac.new(_key(state_dir), message.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class SessionRef:
    token_id: int
    expires: int
    nonce: str


class DenyList:
    """Nonces of signed-out sessions until they expire (bounded; the oldest go first)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until: dict[str, int] = {}

    def add(self, nonce: str, until: int) -> None:
        now = int(time.time())
        with self._lock:
            for n in [n for n, u in self._until.items() if u < now]:
                del self._until[n]
            if len(self._until) >= MAX_DENIED:
                self._until.pop(next(iter(self._until)))
            self._until[nonce] = until

    def __contains__(self, nonce: str) -> bool:
        with self._lock:
            return nonce in self._until


signed_out = DenyList()


def issue(state_dir: Path, token_id: int, now: float | None = None) -> tuple[str, SessionRef]:
    """A new cookie value for ``token_id``, valid for :data:`LIFETIME_S`."""
    ref = SessionRef(
        token_id, int(now if now is not None else time.time()) + LIFETIME_S, secrets.token_hex(16)
    )
    body = f"{ref.token_id}.{ref.expires}.{ref.nonce}"
    return f"{body}.{_mac(state_dir, 'session|' + body)}", ref


def read(state_dir: Path, value: str | None, now: float | None = None) -> SessionRef | None:
    """The session a cookie names, or None (malformed, forged, expired or signed out)."""
    if not value or len(value) > 200:
        return None
    parts = value.split(".")
    if len(parts) != 4 or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    body = ".".join(parts[:3])
    if not hmac.compare_digest(parts[3], _mac(state_dir, "session|" + body)):
        return None
    ref = SessionRef(int(parts[0]), int(parts[1]), parts[2])
    if ref.expires < (now if now is not None else time.time()) or ref.nonce in signed_out:
        return None
    return ref


def csrf_token(state_dir: Path, nonce: str) -> str:
    return _mac(state_dir, "csrf|" + nonce)[:40]


def csrf_ok(state_dir: Path, nonce: str | None, presented: str | None) -> bool:
    if not nonce or not presented:
        return False
    return hmac.compare_digest(csrf_token(state_dir, nonce), presented)
