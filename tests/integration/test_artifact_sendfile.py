"""Boot artifacts from a real `bcm serve`: whole files go by sendfile(2) (bcm.pathsend) and arrive intact,
keep-alive survives it, a Range request and a HEAD still work, and a client that leaves mid-download gives its
transfer slot back. The image is published by the images service (as in tests/api/test_pxe_api.py)."""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlmodel import Session

from bcm.db import make_engine
from bcm.devserver import Server
from bcm.drivers import imagebuild
from bcm.services import images as image_svc
from bcm.settings import Settings

SIZE = 24 << 20


def publish(state: Path) -> tuple[str, bytes]:
    """Version 1 of image ``art`` with a random root image of SIZE bytes; its path and its bytes."""
    settings = Settings(state_dir=state)
    engine = make_engine(settings.effective_database_url, settings.db)
    data = os.urandom(SIZE)
    with Session(engine) as s:
        image = image_svc.begin_build(s, "art", None, "test")
        staging = image_svc.staging_dir(settings.images_dir, "art", image.version, 1)
        staging.mkdir(parents=True)
        found = []
        for kind, filename, body in (
            ("kernel", "vmlinuz", b"k"),
            ("initramfs", "initramfs.img", b"i"),
            ("rootfs", "rootfs.squashfs", data),
        ):
            (staging / filename).write_bytes(body)
            found.append(imagebuild.Artifact(kind, filename, len(body), hashlib.sha256(body).hexdigest()))
        image_svc.publish(s, image, staging, settings.images_dir, found, {}, 3)
        s.commit()
        path = f"/boot/v1/images/art/{image.version}/rootfs.squashfs"
    engine.dispose()
    return path, data


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Server, str, bytes]]:
    server = Server(tmp_path / "state", extra_env={"BCM_IMAGES__MAX_TRANSFERS": "1"})
    server.start()
    try:
        path, data = publish(server.state_dir)
        yield server, path, data
    finally:
        server.stop()


def counters(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.token()}"}).text
    found = re.findall(r'^bcm_boot_artifact_(bytes_total\{way="\w+"\}|aborted_total) (\S+)$', text, re.M)
    return {k: float(v) for k, v in found}


def test_whole_files_go_by_sendfile_on_one_kept_alive_connection(served: tuple[Server, str, bytes]) -> None:
    server, path, data = served
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        for _ in range(2):  # the second answer on the same connection proves the cycle was closed properly
            conn.request("GET", path)
            r = conn.getresponse()
            body = r.read()
            assert r.status == 200
            assert int(r.headers["content-length"]) == SIZE
            assert hashlib.sha256(body).digest() == hashlib.sha256(data).digest()
        assert r.headers.get("connection", "").lower() != "close"
    finally:
        conn.close()
    got = counters(server)
    assert got['bytes_total{way="sendfile"}'] == 2 * SIZE
    assert got['bytes_total{way="copy"}'] == 0
    assert got["aborted_total"] == 0


def test_a_range_goes_by_sendfile_and_several_ranges_still_answer(served: tuple[Server, str, bytes]) -> None:
    """One range (what the init fetches the root image by) is a 206 by sendfile on a kept-alive connection;
    several at once are a multipart 206; a range past the end is a 416 naming the size; nothing else."""
    server, path, data = served
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for first, last in ((1000, 1999), (SIZE - 4096, SIZE - 1), (0, SIZE - 1)):
            r = client.get(path, headers={"Range": f"bytes={first}-{last}"})
            assert r.status_code == 206 and r.content == data[first : last + 1]
            assert r.headers["content-range"] == f"bytes {first}-{last}/{SIZE}"
            assert r.headers["etag"] == f'"{hashlib.sha256(data).hexdigest()}"'
        tail = client.get(path, headers={"Range": "bytes=-500"})  # the last 500 bytes
        assert tail.status_code == 206 and tail.content == data[-500:]
        assert counters(server)['bytes_total{way="sendfile"}'] == 1000 + 4096 + SIZE + 500
        assert counters(server)['bytes_total{way="copy"}'] == 0

        several = client.get(path, headers={"Range": "bytes=0-9, 5000-5009"})
        assert several.status_code == 206
        boundary = several.headers["content-type"].split("boundary=", 1)[1]
        parts = [p for p in several.content.split(f"--{boundary}".encode()) if p.strip(b"-\r\n")]
        assert [p.partition(b"\r\n\r\n")[2].removesuffix(b"\r\n") for p in parts] == [
            data[:10],
            data[5000:5010],
        ]
        assert b"Content-Range: bytes 5000-5009/" in parts[1]

        past = client.get(path, headers={"Range": f"bytes={SIZE}-{SIZE + 10}"})
        assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{SIZE}"
        backwards = client.get(path, headers={"Range": "bytes=20-10"})
        assert backwards.status_code in (400, 416)
        assert client.get(path, headers={"Range": "pages=1-2"}).status_code == 400
        # MAX_TRANSFERS=1 throughout: every answer above gave its slot back
        assert client.get(path).status_code == 200


def test_a_client_that_leaves_mid_download_gives_its_slot_back(served: tuple[Server, str, bytes]) -> None:
    server, path, data = served
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # close = RST
    sock.close()
    # the only transfer slot (MAX_TRANSFERS=1) comes back once the server sees the reset: bounded wait
    status = 0
    for _ in range(100):
        r = httpx.get(f"{server.url}{path}", timeout=30)
        status = r.status_code
        if status != 503:
            break
        time.sleep(0.1)
    assert status == 200
    assert hashlib.sha256(r.content).digest() == hashlib.sha256(data).digest()
    got = counters(server)
    assert got["aborted_total"] == 1
    assert got['bytes_total{way="sendfile"}'] == SIZE


def test_head_answers_the_headers_of_a_get_and_holds_no_slot(served: tuple[Server, str, bytes]) -> None:
    """`curl -I` on an artifact: its size and ETag, no body; the only transfer slot is free at once."""
    server, path, data = served
    with httpx.Client(base_url=server.url, timeout=30) as client:
        heads = [client.head(path) for _ in range(3)]  # MAX_TRANSFERS=1: a held slot would make these 503
        got = client.get(path)
    for head in heads:
        assert head.status_code == 200 and head.content == b""
        assert int(head.headers["content-length"]) == SIZE
        assert head.headers["etag"] == f'"{hashlib.sha256(data).hexdigest()}"'
    assert got.status_code == 200 and got.content == data
    assert counters(server)['bytes_total{way="sendfile"}'] == SIZE  # only the GET sent the file


def _stalled_download(server: Server, path: str, source: str) -> socket.socket:
    """A download from ``source`` (a loopback address) that reads the status line and then nothing."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10, source_address=(source, 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    return sock


def test_one_client_cannot_hold_every_slot(tmp_path: Path) -> None:
    """20 stalled readers from one address hold only its share; another address still downloads."""
    server = Server(
        tmp_path / "state",
        extra_env={"BCM_IMAGES__MAX_TRANSFERS": "4", "BCM_IMAGES__MAX_TRANSFERS_PER_CLIENT": "2"},
    )
    server.start()
    held: list[socket.socket] = []
    try:
        path, data = publish(server.state_dir)
        held = [_stalled_download(server, path, "127.0.0.1") for _ in range(2)]
        refused = httpx.get(f"{server.url}{path}", timeout=30)  # the same address: over its share
        assert refused.status_code == 503 and "already has 2" in refused.json()["message"]
        other = socket.create_connection(
            ("127.0.0.1", server.port), timeout=30, source_address=("127.0.0.2", 0)
        )
        with other:
            other.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            answer = b""
            while chunk := other.recv(1 << 20):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and body == data
    finally:
        for sock in held:
            sock.close()
        server.stop()


def test_a_reader_under_the_minimum_rate_is_dropped_and_frees_its_slot(tmp_path: Path) -> None:
    server = Server(
        tmp_path / "state",
        extra_env={
            "BCM_IMAGES__MAX_TRANSFERS": "1",
            "BCM_IMAGES__MIN_RATE_BYTES_S": str(8 << 20),
            "BCM_IMAGES__MIN_RATE_WINDOW_S": "1",
        },
    )
    server.start()
    try:
        path, data = publish(server.state_dir)
        with _stalled_download(server, path, "127.0.0.1"):  # takes a few buffers' worth, then nothing
            status = 503
            for _ in range(100):  # bounded: the slot comes back once the stalled reader's window is judged
                r = httpx.get(f"{server.url}{path}", timeout=30)
                status = r.status_code
                if status != 503:
                    break
                time.sleep(0.1)
            assert status == 200 and r.content == data
        assert counters(server)["aborted_total"] == 1
        assert "under the minimum" in (server.log.read_text() if server.log else "")
    finally:
        server.stop()
