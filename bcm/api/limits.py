"""Request limits applied before any route runs: body size (413), JSON depth (400), control characters
in admin API bodies (422 naming the field), and a per-address brake on failed authentication (429).

The body of every request is read here, at most ``max_body_bytes`` of it, and replayed to the app, so
no handler ever sees an oversize or too deeply nested body.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from bcm.errors import BadRequest, BcmError, InvalidInput, PayloadTooLarge, TooManyRequests

log = logging.getLogger("bcm.api.auth")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'"[]{}')
_INNERMOST = re.compile(rb"\[\]|\{\}")
# C0 controls, DEL and C1 controls (ANSI escapes start with ESC or CSI)
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def json_depth(body: bytes, limit: int = 1 << 30) -> int:
    """The deepest nesting of arrays/objects in a JSON text, without parsing it (at most ``limit + 1``).

    Escaped backslashes and quotes go first, then everything but quotes and brackets (C speed), then the
    strings; what is left is brackets only. Each pass removes every innermost pair (a regex, C speed), so
    the number of passes is the depth, and it stops one past ``limit``.
    """
    if b"\\" in body:
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    kept = body.translate(None, _NOT_STRUCTURE)
    brackets = b"".join(kept.split(b'"')[::2])  # outside strings: before the first quote, between pairs
    depth = 0
    while brackets and depth <= limit:
        brackets, removed = _INNERMOST.subn(b"", brackets)
        if not removed:  # unbalanced: the parser will say what is wrong with it
            break
        depth += 1
    return depth


def control_char_field(value: Any, path: str = "") -> str | None:
    """The path of the first string (key or value) holding a control character, or None."""
    if isinstance(value, str):
        return (path or "body") if CONTROL_CHARS.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            sub = f"{path}.{key}" if path else str(key)
            if CONTROL_CHARS.search(str(key)):
                return sub
            found = control_char_field(item, sub)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = control_char_field(item, f"{path}.{i}" if path else str(i))
            if found:
                return found
    return None


class AuthFailures:
    """Failed authentications per client address in a sliding window; over the limit → 429."""

    def __init__(self, limit: int, window_s: float = 60.0, max_clients: int = 10_000) -> None:
        self.limit, self.window_s, self.max_clients = limit, window_s, max_clients
        self._seen: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def _recent(self, client: str, now: float) -> deque[float]:
        q = self._seen.get(client)
        if q is None:
            if len(self._seen) >= self.max_clients:  # bounded memory: forget the oldest address
                self._seen.pop(next(iter(self._seen)))
            q = self._seen[client] = deque()
        while q and now - q[0] > self.window_s:
            q.popleft()
        return q

    def check(self, client: str) -> None:
        """Refuse a client that has failed too often lately (before its token is even looked at)."""
        now = time.monotonic()
        with self._lock:
            q = self._recent(client, now)
            if len(q) >= self.limit:
                retry = max(1, int(self.window_s - (now - q[0])) + 1)
                raise TooManyRequests(
                    f"too many failed authentications from {client}; retry in {retry} s", retry_after=retry
                )

    def refusal(self, client: str, path: str, reason: str, error: BcmError) -> BcmError:
        """Count a failed authentication and give the error to raise: ``error`` itself, or a 429 once the
        client is over the limit (the caller verifies first, so a valid token is never braked)."""
        self.failed(client, path, reason)
        try:
            self.check(client)
        except TooManyRequests as braked:
            return braked
        return error

    def failed(self, client: str, path: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._recent(client, now).append(now)
        # the token itself is never logged, only where the attempt came from and why it failed
        log.warning("authentication failed from %s for %s: %s", client, path, reason)


class BodyLimits:
    """ASGI middleware: bound the body, its JSON nesting and (under /api/) its control characters."""

    def __init__(
        self, app: ASGIApp, max_body_bytes: int, max_json_depth: int, self_limited: frozenset[str] = frozenset()
    ) -> None:
        self.app, self.max_body_bytes, self.max_json_depth = app, max_body_bytes, max_json_depth
        # paths whose route caps its own body and parses it in pydantic's JSON parser (Rust, its nesting
        # bounded at 200, no Python recursion): no second read and scan of every agent report
        self.self_limited = self_limited

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] in ("GET", "HEAD", "OPTIONS")
            or scope["path"] in self.self_limited
        ):
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
            self._check(scope, body)
        except BcmError as exc:
            await _send_error(send, exc)
            return

        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # http.disconnect once the client goes away

        await self.app(scope, replay, send)

    async def _read(self, scope: Scope, receive: Receive) -> bytes:
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                raise PayloadTooLarge(f"body of {int(value)} bytes exceeds the limit of {self.max_body_bytes}")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise PayloadTooLarge(f"body exceeds the limit of {self.max_body_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    def _check(self, scope: Scope, body: bytes) -> None:
        if not body or body.lstrip()[:1] not in (b"{", b"["):
            return
        if json_depth(body, self.max_json_depth) > self.max_json_depth:
            raise BadRequest(f"JSON nested deeper than {self.max_json_depth} levels", field="body")
        if not scope.get("path", "").startswith("/api/"):
            return
        try:
            parsed = json.loads(body)
        except ValueError:
            return  # the route's own validation names what is wrong with it
        field = control_char_field(parsed)
        if field:
            raise InvalidInput(f"{field}: control characters are not allowed", field=field)


async def _send_error(send: Send, exc: BcmError) -> None:
    body = json.dumps(exc.to_dict()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers().items()]
    if exc.status_code == 413:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": exc.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})
