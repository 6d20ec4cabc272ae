"""Slow readers cannot hold image-download slots (#26): a floor on the rate over a window, judged on a
clock the test drives, on a real socket; and slots bounded per client address."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from bcm.api.boot.images import Transfers, held_to_a_floor
from bcm.errors import Unavailable
from bcm.pathsend import RateFloor, SlowReader, sendfile


class SteppingClock:
    """Each reading is ``step`` seconds after the last."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_window_under_the_floor_drops_the_reader_and_one_over_it_goes_on() -> None:
    clock = SteppingClock(0.0)
    floor = RateFloor(1000, 10.0, clock)
    floor.moved_bytes(9_999)
    clock.now += 10
    with pytest.raises(SlowReader, match="9999 bytes in 10 s"):
        floor.judge()
    floor = RateFloor(1000, 10.0, clock)
    floor.moved_bytes(10_000)
    clock.now += 10
    floor.judge()  # enough: the next window starts
    assert floor.moved == 0 and floor.left() == 10.0


def test_sendfile_to_a_client_that_stops_reading_is_dropped(tmp_path: Path) -> None:
    big = tmp_path / "rootfs"
    big.write_bytes(os.urandom(16 << 20))  # far more than the socket buffers hold
    server, client = socket.socketpair()
    server.setblocking(False)
    try:
        # the client reads nothing; every clock reading is a whole window later, so the first window is
        # judged at once: the few hundred KiB the buffers took are under 1 MiB/s
        with pytest.raises(SlowReader):
            asyncio.run(
                sendfile(
                    server.fileno(),
                    str(big),
                    0,
                    big.stat().st_size,
                    RateFloor(1 << 20, 1.0, SteppingClock(1.0)),
                )
            )
    finally:
        server.close()
        client.close()


@pytest.mark.parametrize("offset", [0, 123_457])
def test_sendfile_to_a_client_that_reads_arrives_whole(tmp_path: Path, offset: int) -> None:
    """The file, or the part of it from ``offset`` (a range), on the event loop with no thread of its own."""
    data = os.urandom(4 << 20)
    big = tmp_path / "rootfs"
    big.write_bytes(data)
    server, client = socket.socketpair()
    server.setblocking(False)
    got = bytearray()

    def read() -> None:
        client.settimeout(30)
        while len(got) < len(data) - offset:
            chunk = client.recv(1 << 16)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    threads = threading.active_count()

    async def send() -> int:
        await sendfile(server.fileno(), str(big), offset, len(data) - offset, RateFloor(1, 3600.0))
        return threading.active_count()

    try:
        during = asyncio.run(send())
    finally:
        reader.join(30)
        server.close()
        client.close()
    assert bytes(got) == data[offset:]
    assert during <= threads  # no more than the reader's: the copy started none


def test_a_chunked_body_the_client_does_not_take_is_dropped() -> None:
    async def never_taken(message: Any) -> None:
        await asyncio.Event().wait()  # the transport's buffer is full and the client reads nothing

    async def run() -> None:
        send = held_to_a_floor(never_taken, RateFloor(1 << 20, 1.0, SteppingClock(1.0)))
        await send({"type": "http.response.body", "body": b"x" * 1024, "more_body": True})

    with pytest.raises(SlowReader):
        asyncio.run(asyncio.wait_for(run(), 10))


def test_slots_are_bounded_per_client_address() -> None:
    transfers = Transfers(limit=5, per_client=2)
    transfers.enter("198.18.0.9")
    transfers.enter("198.18.0.9")
    with pytest.raises(Unavailable, match="198.18.0.9 already has 2"):
        transfers.enter("198.18.0.9")
    for _ in range(3):
        transfers.enter(f"198.18.0.{20 + _}")  # other clients still get theirs
    with pytest.raises(Unavailable, match="5 image downloads"):
        transfers.enter("198.18.0.30")
    transfers.leave("198.18.0.9")
    transfers.enter("198.18.0.30")
    assert transfers.active == 5 and transfers.by_client["198.18.0.9"] == 1
