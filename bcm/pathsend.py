"""The ASGI ``http.response.pathsend`` extension for uvicorn: a file, or one byte range of it, goes by ``sendfile(2)``.

uvicorn does not implement pathsend (Granian and Hypercorn do); Starlette's ``FileResponse`` uses it
whenever the server advertises it. This protocol advertises it on plain-TCP connections and answers a
``pathsend`` message by copying the file from the page cache to the socket in the kernel, the way nginx
serves a static file, instead of reading it through Python in chunks. The status line and headers stay
uvicorn's; the body goes around its accounting, so the cycle is told the body is complete.

A byte range goes the same way: where the protocol also advertises :data:`RANGE_EXTENSION`, the message
may carry ``offset`` (bcm's own key; the count is the response's Content-Length), and the 206 that
``bcm.api.boot.images`` answers for one range is sent from there. A server without it never sees the key.

The copy runs on the event loop itself, with no thread per transfer: non-blocking ``sendfile(2)`` on a
``dup`` of the connection's descriptor (so a connection closed under it ends the copy with an error instead
of writing into whatever socket reuses the number), waiting for room with the loop's ``add_writer``. uvloop,
uvicorn's loop here, has no ``loop.sendfile``, and asyncio's would need the transport's own descriptor. A
thousand transfers at once cost a thousand descriptors, not a thousand threads contending for the GIL.
A client that takes nothing for ``STALL_S`` loses its download (its connection is closed), as nginx's
``send_timeout`` does, and so does one that takes less than a minimum rate over a window
(:class:`RateFloor`, ``images.min_rate_bytes_s`` over ``images.min_rate_window_s``): a slow reader cannot
hold a transfer slot for long.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

log = logging.getLogger("bcm.boot")

EXTENSION = "http.response.pathsend"
RANGE_EXTENSION = "bcm.pathsend.range"  # the pathsend message may carry "offset": the range's first byte
STALL_S = 60
FALLBACK_CHUNK = 4 * 1024 * 1024
_reads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="bcm-file-read")  # the fallback's reads only
min_rate: tuple[int, float] = (0, 30.0)  # bytes/s and the window it is judged over; 0: no floor


class SlowReader(TimeoutError):
    """The client took less than the minimum rate over a window."""


class RateFloor:
    """A transfer must move at least ``bytes_s * window_s`` bytes in every window of ``window_s`` seconds."""

    def __init__(self, bytes_s: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.bytes_s, self.window_s, self.clock = bytes_s, window_s, clock
        self.start, self.moved = clock(), 0

    def left(self) -> float:
        """Seconds until the current window is judged."""
        return max(0.0, self.start + self.window_s - self.clock())

    def moved_bytes(self, n: int) -> None:
        """Count ``n`` bytes taken by the client, then judge the window if it is over."""
        self.moved += n
        self.judge()

    def judge(self) -> None:
        now = self.clock()
        if now - self.start < self.window_s:
            return
        if self.moved < self.bytes_s * self.window_s:
            raise SlowReader(
                f"the client took {self.moved} bytes in {now - self.start:.0f} s, under the minimum "
                f"of {self.bytes_s} bytes/s"
            )
        self.start, self.moved = now, 0


def set_min_rate(bytes_s: int, window_s: float) -> None:
    """The floor every download is held to (``bcm serve`` sets it from ``images.*``)."""
    global min_rate
    min_rate = (bytes_s, window_s)


@dataclass
class Stats:
    """What this process sent by pathsend (``/metrics`` shows it): bytes by way, transfers cut short."""

    sendfile_bytes: int = 0
    copied_bytes: int = 0  # the fallback: headers still queued, or no Content-Length
    aborted: int = 0


stats = Stats()


class PathsendProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus ``http.response.pathsend`` (whole files and one range) on
    connections without TLS."""

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        if cycle.scope.get("type") == "http" and _plain_socket(self.transport) is not None:
            extensions = cycle.scope.setdefault("extensions", {})
            extensions[EXTENSION] = {}
            extensions[RANGE_EXTENSION] = {}
            cycle.send = _sender(cycle)  # type: ignore[method-assign]
        super()._start_asgi_task(cycle, app)

    def shutdown(self) -> None:
        """At shutdown an idle TLS connection is dropped at once: closing it politely waits for the client's
        close_notify (asyncio's and uvloop's ssl_shutdown_timeout, 30 s), which an idle keep-alive client
        never sends, and the server's shutdown (then its lifespan's) would wait for it."""
        idle = self.cycle is None or self.cycle.response_complete
        if idle and self.transport.get_extra_info("sslcontext") is not None:
            self.transport.abort()
            return
        super().shutdown()


def _plain_socket(transport: Any) -> Any:
    if transport is None or transport.get_extra_info("sslcontext") is not None:
        return None
    sock = transport.get_extra_info("socket")
    return sock if sock is not None and hasattr(sock, "fileno") else None


def _sender(cycle: RequestResponseCycle) -> Any:
    send = RequestResponseCycle.send.__get__(cycle)

    async def send_with_pathsend(message: Any) -> None:
        if message.get("type") != "http.response.pathsend":
            await send(message)
            return
        await _pathsend(cycle, send, message["path"], int(message.get("offset", 0)))

    return send_with_pathsend


async def _pathsend(cycle: RequestResponseCycle, send: Any, path: str, offset: int = 0) -> None:
    if not cycle.response_started or cycle.response_complete:
        raise RuntimeError("http.response.pathsend comes after http.response.start, once")
    size = cycle.expected_content_length
    transport = cycle.transport
    sock = _plain_socket(transport)
    if cycle.chunked_encoding or sock is None or transport.is_closing() or transport.get_write_buffer_size():
        # no Content-Length, or the headers still queued in the transport: the ordinary body path
        await _send_chunks(send, path, offset, size if not cycle.chunked_encoding else None)
        return
    fd = os.dup(sock.fileno())
    try:
        await sendfile(fd, path, offset, size)
        stats.sendfile_bytes += size
    except (
        OSError
    ) as exc:  # the client went away or stalled, or the file changed size: the connection is done
        stats.aborted += 1
        log.info("boot artifact %s not sent whole: %s", os.path.basename(path), exc)
        transport.close()
        cycle.response_complete = True
        cycle.message_event.set()
        return
    finally:
        os.close(fd)
    cycle.expected_content_length = 0  # the body went by sendfile, around the cycle's own count
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send_chunks(send: Any, path: str, offset: int, size: int | None) -> None:
    loop = asyncio.get_running_loop()
    with open(path, "rb") as f:
        f.seek(offset)
        left = size
        while True:
            want = FALLBACK_CHUNK if left is None else min(FALLBACK_CHUNK, left)
            chunk = await loop.run_in_executor(_reads, f.read, want)
            if left is not None:
                left -= len(chunk)
            more = len(chunk) == want and (left is None or left > 0)
            stats.copied_bytes += len(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": more})
            if not more:
                return


def _wake(room: asyncio.Future[None]) -> None:
    if not room.done():
        room.set_result(None)


async def sendfile(out_fd: int, path: str, offset: int, count: int, floor: RateFloor | None = None) -> None:
    """``count`` bytes of ``path`` from ``offset`` to the non-blocking socket ``out_fd``, on the running loop:
    ``sendfile(2)`` until the socket is full, then the loop's writer callback says when there is room. A
    client that takes nothing for ``STALL_S``, or less than ``floor`` over a window, is dropped (an
    ``OSError``: :class:`SlowReader` or ``TimeoutError``)."""
    if floor is None and min_rate[0] > 0:
        floor = RateFloor(*min_rate)
    clock = floor.clock if floor else time.monotonic
    loop = asyncio.get_running_loop()
    end = offset + count
    with open(path, "rb") as f:
        progress = clock()
        while offset < end:
            try:
                sent = os.sendfile(out_fd, f.fileno(), offset, end - offset)
            except BlockingIOError:
                sent = None
            if sent == 0:
                raise ConnectionError(f"the file ended at byte {offset}, short of {end}")
            if sent:
                offset, progress = offset + sent, clock()
                if floor:
                    floor.moved_bytes(sent)
                continue
            room: asyncio.Future[None] = loop.create_future()
            loop.add_writer(out_fd, _wake, room)
            try:
                wait = max(0.0, STALL_S - (clock() - progress))
                await asyncio.wait([room], timeout=min(wait, floor.left()) if floor else wait)
            finally:
                loop.remove_writer(out_fd)
            if floor:
                floor.judge()
            if not room.done() and clock() - progress >= STALL_S:
                raise TimeoutError(f"the client took nothing for {STALL_S} s")
