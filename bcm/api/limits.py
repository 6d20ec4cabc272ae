"""Request limits applied before any route runs: body size (413), body read time (408), JSON encoding
and depth (400), control characters in admin API bodies and NUL anywhere (422 naming the field), and a
per-address brake on failed authentication (429).

The body of every request is read here, at most ``max_body_bytes`` of it within ``body_timeout_s``, and
replayed to the app, so no handler ever sees an oversize, stalled, non-UTF-8 or too deeply nested body.
A JSON body (``application/json``, ``application/*+json`` or no Content-Type: what FastAPI parses as
JSON) must be UTF-8 without a byte-order mark: Python's JSON parser would otherwise guess UTF-16/32 or
skip a BOM, and every check here would read bytes the parser reads differently.
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

import anyio

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
NUL = re.compile("\x00")
_BOMS = (b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")  # UTF-8, UTF-16/32 LE, UTF-16 BE (UTF-32 BE has NULs)


class RequestTimeout(BcmError):
    """The request body did not arrive in time."""

    status_code = 408


def is_json(scope: Scope) -> bool:
    """Whether FastAPI would parse this request's body as JSON (its own rule: no Content-Type counts)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            return (
                not media
                or media == b"application/json"
                or (media.startswith(b"application/") and media.endswith(b"+json"))
            )
    return True


def json_text(body: bytes) -> str:
    """The text of a JSON body, which must be UTF-8 without a byte-order mark (400 naming ``body``).

    A NUL byte is never in UTF-8 JSON (a string carries it as ``\\u0000``), but it is in every UTF-16 and
    UTF-32 text, so it tells those apart even without a byte-order mark.
    """
    if body.startswith(_BOMS) or b"\x00" in body:
        raise BadRequest("body: JSON must be UTF-8 without a byte-order mark", field="body")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"body: not UTF-8 (byte {exc.start})", field="body") from None


def has_escaped_nul(body: bytes) -> bool:
    """Whether a UTF-8 JSON text may hold a NUL character (``\\u0000`` not itself escaped); cheap, no parse."""
    if b"\\u0000" not in body:
        return False
    return b"\\u0000" in body.replace(b"\\\\", b"")


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


def control_char_field(value: Any, path: str = "", chars: re.Pattern[str] = CONTROL_CHARS) -> str | None:
    """The path of the first string (key or value) holding one of ``chars`` (control characters), or None."""
    if isinstance(value, str):
        return (path or "body") if chars.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            sub = f"{path}.{key}" if path else str(key)
            if chars.search(str(key)):
                return sub
            found = control_char_field(item, sub, chars)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = control_char_field(item, f"{path}.{i}" if path else str(i), chars)
            if found:
                return found
    return None


def nul_refusal(body: bytes) -> InvalidInput | None:
    """A 422 naming the field of a JSON body that holds a NUL character (PostgreSQL stores none), or None."""
    if not has_escaped_nul(body):
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None  # the parser will say what is wrong with it
    field = control_char_field(parsed, chars=NUL)
    return InvalidInput(f"{field}: NUL characters are not allowed", field=field) if field else None


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
        """Refuse a client over the limit (429). Verify first and call :meth:`refusal` on a failure instead:
        a braked address that presents a valid token is let through."""
        now = time.monotonic()
        with self._lock:
            q = self._recent(client, now)
            if len(q) > self.limit:
                raise self._braked(client, q, now)

    def _braked(self, client: str, q: deque[float], now: float) -> TooManyRequests:
        retry = max(1, int(self.window_s - (now - q[0])) + 1)
        return TooManyRequests(
            f"too many failed authentications from {client}; retry in {retry} s", retry_after=retry
        )

    def refusal(self, client: str, path: str, reason: str, error: BcmError) -> BcmError:
        """Count a failed authentication and give the error to raise: ``error`` itself, or a 429 once the
        client has failed more than ``limit`` times in the window (the caller verifies first, so a valid
        token is never braked)."""
        now = time.monotonic()
        with self._lock:
            q = self._recent(client, now)
            q.append(now)
            braked = self._braked(client, q, now) if len(q) > self.limit else None
        if braked is None:  # the token itself is never logged, only where the attempt came from and why
            log.warning("authentication failed from %s for %s: %s", client, path, reason)
            return error
        return braked

    def failed(self, client: str, path: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._recent(client, now).append(now)
        log.warning("authentication failed from %s for %s: %s", client, path, reason)


class BodyLimits:
    """ASGI middleware: bound the body (size, read time), its JSON encoding and nesting, NUL characters,
    and (under /api/) its control characters."""

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        max_json_depth: int,
        self_limited: frozenset[str] = frozenset(),
        body_timeout_s: float = 30.0,
    ) -> None:
        self.app, self.max_body_bytes, self.max_json_depth = app, max_body_bytes, max_json_depth
        self.body_timeout_s = body_timeout_s
        # paths whose route caps its own body and parses it in pydantic's JSON parser (Rust, its nesting
        # bounded at 200, no Python recursion): no second read and scan of every agent report; the route
        # applies the encoding, NUL and time rules itself (bcm.api.boot.agent)
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
            body = await read_body(scope, receive, self.max_body_bytes, self.body_timeout_s)
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

    def _check(self, scope: Scope, body: bytes) -> None:
        if not body or not is_json(scope):
            return  # FastAPI does not parse it as JSON: a route that wants JSON refuses it with a 422
        text = json_text(body)
        if json_depth(body, self.max_json_depth) > self.max_json_depth:
            raise BadRequest(f"JSON nested deeper than {self.max_json_depth} levels", field="body")
        admin_api = scope.get("path", "").startswith("/api/")
        if not admin_api:
            refusal = nul_refusal(body)
            if refusal:
                raise refusal
            return
        try:
            parsed = json.loads(text)
        except ValueError:
            return  # the route's own validation names what is wrong with it
        field = control_char_field(parsed)
        if field:
            raise InvalidInput(f"{field}: control characters are not allowed", field=field)


async def read_body(scope: Scope, receive: Receive, max_bytes: int, timeout_s: float) -> bytes:
    """The whole request body: 413 past ``max_bytes`` (a declared length at once), 408 if it has not all
    arrived within ``timeout_s`` (a client that stalls mid-body holds nothing for longer)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit() and int(value) > max_bytes:
            raise PayloadTooLarge(f"body of {int(value)} bytes exceeds the limit of {max_bytes}")
    chunks, size = [], 0
    with anyio.move_on_after(timeout_s) as scope_timer:
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_bytes:
                raise PayloadTooLarge(f"body exceeds the limit of {max_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
    if scope_timer.cancelled_caught:
        raise RequestTimeout(f"body: not received within {timeout_s:g} s", field="body")
    return b"".join(chunks)


async def _send_error(send: Send, exc: BcmError) -> None:
    body = json.dumps(exc.to_dict()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers().items()]
    if exc.status_code in (408, 413):  # the rest of the body is not read: the connection cannot be reused
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": exc.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})
