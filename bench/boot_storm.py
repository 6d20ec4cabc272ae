"""Benchmark: a boot storm. N simulated machines do the HTTP side of the whole PXE chain at once against a
real `bcm serve` (SQLite), and the same download load against nginx with a minimal callback peer, in one run.

Setup through the product's own API (not timed): an image published through the images service (random
kernel, initramfs and root image of the sizes given), a category with that image and Redfish BMCs over http,
the nodes registered with MACs (``POST /api/v1/nodes/bulk``), each given its own BMC address and password.
The BMCs are one fake Redfish service (a child process, on 127.78.x.y, one address per machine) that
answers what bcm's sushy driver asks and "presses the power button" of its machine when bcm powers it on.

Timed, bcm: ``provision`` for all nodes (one verb); bcm's provisioner sets next boot PXE and powers each
machine on through its BMC (at most ``BCM_PXE__MAX_CONCURRENT`` provisioning at once; the rest wait in
bcm's queue); each machine, from its own loopback address 127.77.x.y, then does what the real one does:
``GET /boot/v1/ipxe/boot.ipxe`` and ``/boot/v1/ipxe/<mac>`` (the script with its one-time boot token), the
kernel and initramfs the script names, the root image by HTTP ranges (``--range-mib``), its overlay with the
boot token, ``POST /boot/v1/hello`` (boot token → agent token; the node is ``booted``), its facts (no
node-side facts endpoint exists yet: skipped, and said so) and a first GPU health report
(``POST /boot/v1/agent/report``, a recorded H100 report). A 503 (bcm's transfer cap) is retried after its
Retry-After and counted apart: the real initramfs's busybox wget does not retry, so each would be a failed
boot on real hardware.

Timed, nginx: the same files (hard links), the same scripts (URLs pointed at nginx, the callback at the
peer: a tiny asyncio HTTP server answering hello/report), the same overlays; each machine starts at the same
offset after the first power-on as it did in bcm's run, so both see the same arrivals.

Prints time to all-booted, bytes/s of each beside loopback's measured limit (one TCP stream, sendfile to
recv_into) for the whole chain (to the last callback's byte) and for the artifacts alone (to the last
kernel, initramfs or root-image byte: what nginx and bcm both serve, apart from bcm's control plane),
failures (goal 0), the bcm server's peak RSS (VmHWM) and database rows, and bcm/nginx (goal
>= 0.9x); asserts nothing. Loopback only (127.0.0.0/8); every request and the whole run bounded in time.
Server settings: every BCM_* variable set where this runs goes to the server. ``BCM_PXE__MAX_CONCURRENT``
(how many nodes bcm provisions at once; its default is 20) is --machines here unless set, so that all boot
at once; set lower, the rest wait in bcm's queue and nginx's run replays the same waves.
``BCM_POWER__POLL_INTERVAL_S`` is 0 unless set (no background power-state reads of 1,000 BMCs meanwhile).
Usage: .venv/bin/python bench/boot_storm.py [--machines 1000] [--rootfs-mib 64] [--kernel-mib 8]
    [--initramfs-mib 8] [--range-mib 16] [--request-timeout 300] [--timeout 900]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import ipaddress
import json
import multiprocessing as mp
import os
import re
import resource
import socket
import sqlite3
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from boot import ensure_nginx
from common import pct
from health import bodies, template
from sqlmodel import Session

from bcm.api.boot.images import transfer_limit
from bcm.db import make_engine
from bcm.devserver import Server, free_port
from bcm.drivers import imagebuild
from bcm.services import images as image_svc
from bcm.settings import Settings

IMAGE, CATEGORY, BMC_PASSWORD = "storm", "storm", "storm-bmc-pw"
MACHINE_NET, BMC_NET = ipaddress.ip_address("127.77.0.1"), ipaddress.ip_address("127.78.0.1")
FIRST_MAC = "52:54:00:77:00:01"
CHUNK = 1 << 20
NGINX_CONF = """
worker_processes 2;
user root;  # the files are in bcm's state directory (0700)
pid {dir}/nginx.pid;
error_log {dir}/error.log;
worker_rlimit_nofile 8192;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 10000;
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        root {root};
        location / {{ default_type application/octet-stream; }}
    }}
}}
"""


# ---- a minimal HTTP/1.1 server (the fake BMCs, the callback peer) and client -----------------------------

Handler = Callable[[str, str, bytes, str], tuple[int, bytes]]


def serve_http(hosts: list[str], port: int, handle: Handler, ready: Any) -> None:
    """Answer HTTP/1.1 (keep-alive, Content-Length bodies) on ``hosts``:``port`` until killed."""

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        local = writer.get_extra_info("sockname")[0]
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *rest = head.decode("latin-1").split("\r\n")
                method, path, _ = line.split(" ", 2)
                length = next(
                    (int(h.split(":", 1)[1]) for h in rest if h.lower().startswith("content-length:")), 0
                )
                body = await reader.readexactly(length) if length else b""
                code, answer = handle(method, path, body, local)
                writer.write(
                    f"HTTP/1.1 {code} X\r\nContent-Type: application/json\r\nContent-Length: {len(answer)}"
                    f"\r\n\r\n".encode()
                    + answer
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(client, hosts, port, backlog=4096)
        ready.send("ready")
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def bmc_service(hosts: list[str], port: int, events: Any) -> None:
    """One Redfish BMC per address (the shape sushy-tools' emulator answers); a reset that powers the machine
    on sends (address, monotonic time) to the benchmark: that machine's power button was pressed."""
    power: dict[str, str] = {h: "Off" for h in hosts}
    system = "/redfish/v1/Systems/1"

    def handle(method: str, path: str, body: bytes, local: str) -> tuple[int, bytes]:
        path = path.rstrip("/") or "/"
        if method == "GET" and path == "/redfish/v1":
            return 200, json.dumps(
                {
                    "@odata.id": "/redfish/v1/",
                    "@odata.type": "#ServiceRoot.v1_5_0.ServiceRoot",
                    "Id": "RootService",
                    "RedfishVersion": "1.5.0",
                    "Systems": {"@odata.id": "/redfish/v1/Systems"},
                }
            ).encode()
        if method == "GET" and path == "/redfish/v1/Systems":
            return 200, json.dumps(
                {
                    "@odata.id": "/redfish/v1/Systems",
                    "Members@odata.count": 1,
                    "@odata.type": "#ComputerSystemCollection.ComputerSystemCollection",
                    "Members": [{"@odata.id": system}],
                }
            ).encode()
        if method == "GET" and path == system:
            return 200, json.dumps(
                {
                    "@odata.id": system,
                    "@odata.type": "#ComputerSystem.v1_10_0.ComputerSystem",
                    "Id": "1",
                    "PowerState": power[local],
                    "Boot": {
                        "BootSourceOverrideEnabled": "Once",
                        "BootSourceOverrideTarget": "Pxe",
                        "BootSourceOverrideTarget@Redfish.AllowableValues": ["Pxe", "Hdd"],
                    },
                    "Actions": {
                        "#ComputerSystem.Reset": {
                            "target": f"{system}/Actions/ComputerSystem.Reset",
                            "ResetType@Redfish.AllowableValues": [
                                "On",
                                "ForceOff",
                                "GracefulShutdown",
                                "ForceRestart",
                            ],
                        }
                    },
                }
            ).encode()
        if method == "PATCH" and path == system:
            return 204, b""
        if method == "POST" and path == f"{system}/Actions/ComputerSystem.Reset":
            kind = json.loads(body or b"{}").get("ResetType")
            if kind in ("On", "ForceOn", "ForceRestart", "GracefulRestart", "PowerCycle"):
                power[local] = "On"
                events.send((local, time.monotonic()))
            elif kind in ("ForceOff", "GracefulShutdown"):
                power[local] = "Off"
            return 204, b""
        return 404, b'{"error": "not here"}'

    serve_http(hosts, port, handle, events)


def callback_peer(port: int, ready: Any) -> None:
    """nginx's partner: answers hello and reports as bcm would, and does nothing else."""

    def handle(method: str, path: str, body: bytes, local: str) -> tuple[int, bytes]:
        if method == "POST" and path == "/boot/v1/hello":
            return 200, b'{"node": "peer", "state": "booted", "agent_token": "peer"}'
        if method == "POST" and path == "/boot/v1/agent/report":
            return 202, b'{"verdict": "OK"}'
        return 404, b"{}"

    serve_http(["127.0.0.1"], port, handle, ready)


class Busy(Exception):
    def __init__(self, after: float) -> None:
        self.after = after


class Conn:
    """One keep-alive HTTP/1.1 connection from a machine's own loopback address (plain asyncio streams: the
    client's CPU goes to moving bytes, not to an HTTP library's bookkeeping; it shares the cores)."""

    def __init__(self, source: str, host: str, port: int) -> None:
        self.source, self.host, self.port = source, host, port
        self.rw: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    def close(self) -> None:
        if self.rw is not None:
            self.rw[1].close()
            self.rw = None

    async def request(
        self,
        method: str,
        path: str,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
        keep: bool = True,
    ) -> tuple[str, bytes, int]:
        """(head in lower case, body if ``keep`` else b"", body length); a 503 raises Busy, another
        status outside 2xx ValueError."""
        if self.rw is None:
            self.rw = await asyncio.open_connection(
                self.host, self.port, local_addr=(self.source, 0), limit=4 * CHUNK
            )
        reader, writer = self.rw
        lines = [
            f"{method} {path} HTTP/1.1",
            f"Host: {self.host}:{self.port}",
            f"Content-Length: {len(body)}",
        ]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
            code = int(head.split(" ", 2)[1])
            m = re.search(r"\r\ncontent-length: *(\d+)", head)
            if m is None:
                raise ValueError(f"{method} {path}: {code} without Content-Length")
            length, got, kept = int(m.group(1)), 0, []
            while got < length:
                chunk = await reader.read(min(CHUNK, length - got))
                if not chunk:
                    raise ConnectionError(f"{method} {path}: closed after {got} of {length} bytes")
                got += len(chunk)
                if keep or code >= 300:
                    kept.append(chunk)
            if "\r\nconnection: close" in head:
                self.close()
        except BaseException:
            self.close()
            raise
        data = b"".join(kept)
        if code == 503:
            m = re.search(r"\r\nretry-after: *(\d+)", head)
            raise Busy(float(m.group(1)) if m else 1.0)
        if not 200 <= code < 300 and code != 206:
            raise ValueError(f"{method} {path}: {code} {data[:200].decode(errors='replace')}")
        return head, data, got


# ---- the simulated machines ----------------------------------------------------------------------------


@dataclass
class Run:
    label: str
    deadline: float
    request_timeout: float
    range_bytes: int
    reports: dict[str, bytes]
    facts_endpoint: bool = False
    t0: float = 0.0
    first_byte: float = 0.0
    last_byte: float = 0.0
    last_image_byte: float = 0.0  # the last byte of a boot artifact (kernel, initramfs, root image)
    moved: int = 0
    image_moved: int = 0
    busy: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    samples: list[str] = field(default_factory=list)
    powered: dict[str, float] = field(default_factory=dict)  # mac → power-on (monotonic)
    booted: dict[str, float] = field(default_factory=dict)  # mac → hello answered
    reported: dict[str, float] = field(default_factory=dict)  # mac → first report accepted
    scripts: dict[str, str] = field(default_factory=dict)
    overlays: dict[str, bytes] = field(default_factory=dict)

    async def call(
        self,
        conn: Conn,
        method: str,
        url: str,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
        keep: bool = True,
    ) -> tuple[str, bytes]:
        """(head, body) of one request, retried after a 503's Retry-After (counted as busy) and, at most
        twice, after an error (each counted as a failure); every try bounded by the request timeout."""
        u = httpx.URL(url)
        if (u.host, u.port or 80) != (conn.host, conn.port):
            conn.close()
            conn.host, conn.port = u.host, u.port or 80
        path = u.raw_path.decode()
        errors = 0
        while True:
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"{self.label}: the run's time is up")
            self.first_byte = self.first_byte or time.monotonic()
            try:
                head, data, got = await asyncio.wait_for(
                    conn.request(method, path, headers, body, keep), self.request_timeout
                )
            except Busy as exc:
                self.busy += 1
                await asyncio.sleep(min(exc.after, 5.0))
                continue
            except (
                OSError,
                ValueError,
                TimeoutError,
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
            ) as exc:
                errors += 1
                what = path.split("/")[3] if path.startswith("/boot/v1/") else path
                self.failures[f"{method} {what}: {type(exc).__name__}"] += 1
                if len(self.samples) < 5:
                    self.samples.append(f"{method} {path}: {type(exc).__name__}: {exc}"[:300])
                if errors > 2:
                    raise
                await asyncio.sleep(1)
                continue
            self.moved += got
            self.last_byte = time.monotonic()
            if path.startswith("/boot/v1/images/"):
                self.image_moved += got
                self.last_image_byte = self.last_byte
            return head, data

    async def machine(self, mac: str, source: str, base: str, power_on: Awaitable[float]) -> None:
        """One machine from its power button to its first health report."""
        self.powered[mac] = await power_on
        u = httpx.URL(base)
        conn = Conn(source, u.host, u.port or 80)
        try:
            _, entry = await self.call(conn, "GET", f"{base}/boot/v1/ipxe/boot.ipxe")
            chained = re.search(r"chain --autofree (\S+)/boot/v1/ipxe/", entry.decode())
            _, text = await self.call(
                conn, "GET", f"{chained.group(1) if chained else base}/boot/v1/ipxe/{mac.replace(':', '-')}"
            )
            script = self.scripts[mac] = text.decode()
            kernel = re.search(r"^kernel --name \S+ (\S+) (.*?) \|\| goto", script, re.M)
            initrd = re.search(r"^initrd --name \S+ (\S+)", script, re.M)
            if kernel is None or initrd is None:
                raise ValueError(f"{mac}: not an image script: {script[:300]}")
            args = dict(a.split("=", 1) for a in kernel.group(2).split() if a.startswith("bcm.") and "=" in a)
            await self.call(conn, "GET", kernel.group(1), keep=False)  # iPXE: one connection, whole files
            await self.call(conn, "GET", initrd.group(1), keep=False)
            conn.close()  # the initramfs: a new TCP stack, new connections
            offset, size = 0, 1
            while offset < size:
                head, _ = await self.call(
                    conn,
                    "GET",
                    args["bcm.root"],
                    {"Range": f"bytes={offset}-{offset + self.range_bytes - 1}"},
                    keep=False,
                )
                m = re.search(r"\r\ncontent-range: *bytes (\d+)-(\d+)/(\d+)", head)
                if m is None:
                    raise ValueError(f"{mac}: the root image came without Content-Range")
                offset, size = int(m.group(2)) + 1, int(m.group(3))
            token = {"Authorization": f"Bearer {args['bcm.token']}"}
            _, self.overlays[mac] = await self.call(conn, "GET", args["bcm.overlay"], token)
            conn.close()  # the booted system: bcm-hello, then the agent
            _, hello = await self.call(
                conn,
                "POST",
                f"{args['bcm.server']}/boot/v1/hello",
                {"Content-Type": "application/json", **token},
                json.dumps({"mac": mac}).encode(),
            )
            self.booted[mac] = time.monotonic()
            agent = {
                "Authorization": f"Bearer {json.loads(hello)['agent_token']}",
                "Content-Type": "application/json",
            }
            await self.call(
                conn,
                "POST",
                f"{args['bcm.server']}/boot/v1/agent/report",
                agent,
                self.reports[args["bcm.node"]],
            )
            self.reported[mac] = time.monotonic()
        except Exception as exc:  # one machine's failure must not stop the others
            self.failures[f"machine gave up: {type(exc).__name__}"] += 1
            if len(self.samples) < 5:
                self.samples.append(f"{mac}: {type(exc).__name__}: {exc}"[:300])
        finally:
            conn.close()


# ---- setup, the two runs, the figures ------------------------------------------------------------------


def publish(state: Path, sizes: dict[str, int]) -> Path:
    """Version 1 of IMAGE from random files of ``sizes`` bytes, through the images service (as bench/boot.py)."""
    settings = Settings(state_dir=state)
    engine = make_engine(settings.effective_database_url, settings.db)
    with Session(engine) as s:
        image = image_svc.begin_build(s, IMAGE, None, "bench")
        staging = image_svc.staging_dir(settings.images_dir, IMAGE, image.version, 1)
        staging.mkdir(parents=True)
        found = []
        for kind, filename in (
            ("kernel", "vmlinuz"),
            ("initramfs", "initramfs.img"),
            ("rootfs", "rootfs.squashfs"),
        ):
            h = hashlib.sha256()
            with open(staging / filename, "wb") as f:
                left = sizes[kind]
                while left:
                    chunk = os.urandom(min(left, 4 << 20))
                    f.write(chunk)
                    h.update(chunk)
                    left -= len(chunk)
            found.append(imagebuild.Artifact(kind, filename, sizes[kind], h.hexdigest()))
        image_svc.publish(s, image, staging, settings.images_dir, found, {}, 3)
        s.commit()
        version = image.version
    engine.dispose()
    return image_svc.version_dir(settings.images_dir, IMAGE, version)


def register(server: Server, n: int, bmc_port: int) -> tuple[str, list[tuple[str, str, str]]]:
    """(hostlist, [(name, mac, bmc address)]) of ``n`` nodes registered through the API, BMCs and passwords set."""
    width = len(str(n))
    hostlist = f"storm[{1:0{width}d}-{n:0{width}d}]"
    with httpx.Client(
        base_url=server.url,
        headers={"Authorization": f"Bearer {server.token()}"},
        timeout=120,
        trust_env=False,
    ) as api:

        def ok(r: httpx.Response) -> Any:
            if r.status_code >= 300:
                raise SystemExit(f"{r.request.method} {r.request.url.path}: {r.status_code} {r.text[:500]}")
            return r.json()

        ok(
            api.post(
                "/api/v1/categories",
                json={"name": CATEGORY, "image": IMAGE, "bmc_protocol": "redfish", "bmc_user": "admin"},
            )
        )
        ok(api.put(f"/api/v1/categories/{CATEGORY}/bmc-allow-http", json={"allow": True}))
        created = ok(
            api.post("/api/v1/nodes/bulk", json={"nodes": hostlist, "category": CATEGORY, "mac": FIRST_MAC})
        )
        nodes = sorted((c["name"], c["interfaces"][0]["mac"]) for c in created)
        machines = [(name, mac, str(BMC_NET + i)) for i, (name, mac) in enumerate(nodes)]

        def bmc(m: tuple[str, str, str]) -> None:
            ok(api.patch(f"/api/v1/nodes/{m[0]}", json={"bmc_address": f"http://{m[2]}:{bmc_port}"}))

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(bmc, machines))
        ok(api.put("/api/v1/nodes/bmc-password", json={"nodes": hostlist, "password": BMC_PASSWORD}))
    return hostlist, machines


def child(target: Callable[..., None], *args: Any) -> tuple[Any, Any]:
    """(process, our end of its pipe) of a helper process, once it listens."""
    ours, theirs = mp.get_context("fork").Pipe()
    proc = mp.get_context("fork").Process(target=target, args=(*args, theirs), daemon=True)
    proc.start()
    if not ours.poll(30) or ours.recv() != "ready":
        raise SystemExit(f"{target.__name__} did not start")
    return proc, ours


async def storm_bcm(
    run: Run, server: Server, hostlist: str, machines: list[tuple[str, str, str]], events: Any
) -> None:
    """The provision verb, then every machine when its BMC powers it on."""
    loop = asyncio.get_running_loop()
    pressed: dict[str, asyncio.Future[float]] = {bmc: loop.create_future() for _, _, bmc in machines}

    def power_button() -> None:
        while events.poll():
            address, at = events.recv()
            if not pressed[address].done():
                pressed[address].set_result(at)

    loop.add_reader(events.fileno(), power_button)
    try:
        async with httpx.AsyncClient(
            base_url=server.url,
            headers={"Authorization": f"Bearer {server.token()}"},
            timeout=120,
            trust_env=False,
        ) as api:
            run.t0 = time.monotonic()
            r = await api.post(
                "/api/v1/nodes/actions/provision", json={"nodes": hostlist, "reason": "boot storm"}
            )
            if r.status_code >= 300:
                raise SystemExit(f"provision: {r.status_code} {r.text[:500]}")
        waits = [
            run.machine(mac, str(MACHINE_NET + i), server.url, pressed[bmc])
            for i, (_, mac, bmc) in enumerate(machines)
        ]
        await bounded(run, waits)
    finally:
        loop.remove_reader(events.fileno())


async def storm_replayed(
    run: Run, url: str, machines: list[tuple[str, str, str]], offsets: dict[str, float]
) -> None:
    """Every machine pressed at the same offset after the first power-on as in bcm's run."""
    run.t0 = time.monotonic()

    async def press(offset: float) -> float:
        await asyncio.sleep(max(0.0, run.t0 + offset - time.monotonic()))
        return time.monotonic()

    await bounded(
        run,
        [
            run.machine(mac, str(MACHINE_NET + i), url, press(offsets[mac]))
            for i, (_, mac, _) in enumerate(machines)
            if mac in offsets
        ],
    )


async def bounded(run: Run, machines: Sequence[Awaitable[None]]) -> None:
    """All machines, within the run's deadline; a line of progress every 15 s."""

    async def progress() -> None:
        while True:
            await asyncio.sleep(15)
            print(
                f"  [{run.label} {time.monotonic() - run.t0:4.0f} s] powered on {len(run.powered)}, booted "
                f"{len(run.booted)}, reported {len(run.reported)}, {run.moved / (1 << 30):.1f} GiB, busy {run.busy}, "
                f"failures {sum(run.failures.values())}",
                flush=True,
            )

    ticker = asyncio.create_task(progress())
    try:
        await asyncio.wait_for(asyncio.gather(*machines), max(1.0, run.deadline - time.monotonic()))
    except TimeoutError:
        run.failures["run timed out"] += 1
    finally:
        ticker.cancel()


def loopback_limit(path: Path, seconds: float = 3.0) -> float:
    """MiB/s of one TCP stream on loopback: sendfile(2) of ``path`` over and over, read by recv_into."""
    size = path.stat().st_size
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        stop = threading.Event()

        def send() -> None:
            conn, _ = listener.accept()
            with conn, open(path, "rb") as f:
                while not stop.is_set():
                    sent = 0
                    while sent < size:
                        try:
                            sent += os.sendfile(conn.fileno(), f.fileno(), sent, size - sent)
                        except OSError:  # the reader has its figure and is gone
                            return

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        buf = bytearray(CHUNK)
        got = 0
        with socket.create_connection(listener.getsockname()) as sock:
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                got += sock.recv_into(buf)
            elapsed = time.monotonic() - t0
            stop.set()
        sender.join(10)
    return got / (1 << 20) / elapsed


def vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def database_rows(db: Path) -> dict[str, int]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as con:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return {t: int(con.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0]) for t in tables}


def nginx_root(work: Path, run: Run, vdir: Path, bcm_url: str, ngx_url: str, peer_url: str) -> Path:
    """The files bcm served, at the same paths: scripts (URLs → nginx, callback → the peer), image, overlays."""
    root = work / "www"
    images = root / "boot/v1/images" / IMAGE / vdir.name
    images.mkdir(parents=True)
    for f in vdir.iterdir():
        if f.is_file():
            os.link(f, images / f.name)  # same disk, same bytes
    (root / "boot/v1/ipxe").mkdir(parents=True)
    (root / "boot/v1/overlay").mkdir(parents=True)
    (root / "boot/v1/ipxe/boot.ipxe").write_text(
        f"#!ipxe\nchain --autofree {ngx_url}/boot/v1/ipxe/${{netX/mac:hexhyp}} || goto failed\n"
    )
    for mac, script in run.scripts.items():
        text = script.replace(f"bcm.server={bcm_url}", f"bcm.server={peer_url}").replace(bcm_url, ngx_url)
        (root / "boot/v1/ipxe" / mac.replace(":", "-")).write_text(text)
    for mac, data in run.overlays.items():
        (root / "boot/v1/overlay" / mac).write_bytes(data)
    return root


def figures(run: Run) -> dict[str, float]:
    span = max(run.last_byte - run.first_byte, 1e-9)
    first = min(run.powered.values(), default=run.t0)
    per = [run.booted[m] - run.powered[m] for m in run.booted]
    return {
        "power": max(run.powered.values(), default=first) - first,
        "booted": (max(run.booted.values()) - first) if run.booted else float("nan"),
        "reported": (max(run.reported.values()) - first) if run.reported else float("nan"),
        "p50": pct(per, 50) if per else float("nan"),
        "p99": pct(per, 99) if per else float("nan"),
        "mibs": run.moved / (1 << 20) / span,
        "image_mibs": run.image_moved / (1 << 20) / max(run.last_image_byte - run.first_byte, 1e-9),
        "gib": run.moved / (1 << 30),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machines", type=int, default=1000)
    ap.add_argument("--kernel-mib", type=int, default=8)
    ap.add_argument("--initramfs-mib", type=int, default=8)
    ap.add_argument("--rootfs-mib", type=int, default=64)
    ap.add_argument(
        "--range-mib", type=int, default=16, help="the root image is fetched in ranges of this size"
    )
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds for one request")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for each run (bcm, nginx) in all")
    args = ap.parse_args()
    if not 1 <= args.machines <= 10000:
        raise SystemExit("--machines: 1 to 10000")
    nginx = ensure_nginx()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * args.machines + 4096)), hard))
    n = args.machines
    passed = {k: v for k, v in os.environ.items() if k.startswith("BCM_")}
    server_env = {"BCM_PXE__MAX_CONCURRENT": str(n), "BCM_POWER__POLL_INTERVAL_S": "0", **passed}
    sizes = {
        "kernel": args.kernel_mib << 20,
        "initramfs": args.initramfs_mib << 20,
        "rootfs": args.rootfs_mib << 20,
    }
    tmpl = template(8)
    procs: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="bcm-bootstorm-") as tmp:
        work = Path(tmp)
        server = Server(work / "state", extra_env=server_env)
        ngx = None
        try:
            bmc_port, peer_port = free_port(), free_port()
            bmc_proc, events = child(bmc_service, [str(BMC_NET + i) for i in range(n)], bmc_port)
            peer_proc, _ = child(callback_peer, peer_port)
            procs += [bmc_proc, peer_proc]
            server.start()
            assert server.proc is not None
            settings = Settings(state_dir=server.state_dir)
            vdir = publish(server.state_dir, sizes)
            t_setup = time.monotonic()
            hostlist, machines = register(server, n, bmc_port)
            print(
                f"setup: {n} nodes registered with BMCs through the API in {time.monotonic() - t_setup:.1f} s",
                flush=True,
            )
            reports = dict(zip([m[0] for m in machines], bodies([m[0] for m in machines], tmpl), strict=True))
            cpu0 = resource.getrusage(resource.RUSAGE_SELF)
            bcm = Run(
                "bcm", time.monotonic() + args.timeout, args.request_timeout, args.range_mib << 20, reports
            )
            asyncio.run(storm_bcm(bcm, server, hostlist, machines, events))
            cpu1 = resource.getrusage(resource.RUSAGE_SELF)
            hwm = vm_hwm_kib(server.proc.pid)
            kids = {pid: vm_hwm_kib(pid) for pid in children(server.proc.pid)}
            with httpx.Client(
                base_url=server.url,
                headers={"Authorization": f"Bearer {server.token()}"},
                timeout=60,
                trust_env=False,
            ) as api:
                states: Counter[str] = Counter()
                for offset in range(0, n, 1000):
                    page = api.get(
                        "/api/v1/nodes", params={"category": CATEGORY, "limit": 1000, "offset": offset}
                    )
                    states.update(node["provision_state"] for node in page.json()["items"])
            rows = database_rows(server.state_dir / "bcm.db")
            server.stop()

            ngx_port = free_port()
            ngx_url, peer_url = f"http://127.0.0.1:{ngx_port}", f"http://127.0.0.1:{peer_port}"
            root = nginx_root(work, bcm, vdir, server.url, ngx_url, peer_url)
            (work / "nginx").mkdir()
            (work / "nginx" / "nginx.conf").write_text(
                NGINX_CONF.format(dir=work / "nginx", port=ngx_port, root=root)
            )
            ngx = subprocess.Popen([nginx, "-c", str(work / "nginx" / "nginx.conf"), "-g", "daemon off;"])
            time.sleep(1)
            first = min(bcm.powered.values(), default=0.0)
            offsets = {m: t - first for m, t in bcm.powered.items() if m in bcm.scripts}
            ref = Run(
                "nginx", time.monotonic() + args.timeout, args.request_timeout, args.range_mib << 20, reports
            )
            asyncio.run(storm_replayed(ref, ngx_url, machines, offsets))
            cpu2 = resource.getrusage(resource.RUSAGE_SELF)
            limit = loopback_limit(vdir / "rootfs.squashfs")
        finally:
            if ngx is not None:
                ngx.terminate()
                ngx.wait(timeout=10)
            server.stop()
            for proc in procs:
                proc.kill()
                proc.join(10)
    report_figures(
        args,
        server_env,
        settings,
        bcm,
        ref,
        limit,
        hwm,
        kids,
        states,
        rows,
        (
            cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime,
            cpu2.ru_utime + cpu2.ru_stime - cpu1.ru_utime - cpu1.ru_stime,
        ),
    )


def report_figures(
    args: argparse.Namespace,
    env: dict[str, str],
    settings: Settings,
    bcm: Run,
    ref: Run,
    limit: float,
    hwm: int,
    kids: dict[int, int],
    states: Counter[str],
    rows: dict[str, int],
    client_cpu: tuple[float, float],
) -> None:
    b, r = figures(bcm), figures(ref)
    load = os.getloadavg()[0]
    print(
        f"\nboot storm: {args.machines} machines, kernel {args.kernel_mib} MiB + initramfs {args.initramfs_mib} MiB "
        f"+ root image {args.rootfs_mib} MiB in {args.range_mib} MiB ranges (loopback, {os.cpu_count()} cores, "
        f"load {load:.1f} now)"
    )
    print(
        f"  BCM_PXE__MAX_CONCURRENT={env['BCM_PXE__MAX_CONCURRENT']}: how many nodes bcm provisions at once (it "
        "powers them on through their BMCs and waits for their callbacks; the rest wait queued). It bounds "
        "no download."
    )
    served = Settings(pxe={"max_concurrent": int(env["BCM_PXE__MAX_CONCURRENT"])})  # the limit bcm serve used
    im = settings.images
    cap = (
        env.get("BCM_IMAGES__MAX_TRANSFERS", f"unset: {transfer_limit(served)}"),
        env.get("BCM_IMAGES__MAX_TRANSFERS_PER_CLIENT", str(im.max_transfers_per_client)),
    )
    print(
        f"  BCM_IMAGES__MAX_TRANSFERS={cap[0]} (per client address {cap[1]}): image downloads in flight; more "
        "get 503 + Retry-After (retried here, counted as busy)"
    )
    print(f"  loopback's limit: {limit:,.0f} MiB/s (one TCP stream, sendfile → recv_into)")
    print(
        "  facts: no node-side facts endpoint exists (the SSH inventory after the callback collects them): skipped"
    )
    rows_ = [
        ("powered on: first → last (s)", f"{b['power']:.1f}", f"{r['power']:.1f} (replayed)"),
        ("first power-on → all booted (s)", f"{b['booted']:.1f}", f"{r['booted']:.1f}"),
        ("first power-on → all reported (s)", f"{b['reported']:.1f}", f"{r['reported']:.1f}"),
        (
            "per machine power-on → booted p50/p99 (s)",
            f"{b['p50']:.1f} / {b['p99']:.1f}",
            f"{r['p50']:.1f} / {r['p99']:.1f}",
        ),
        (
            "booted / reported machines",
            f"{len(bcm.booted)} / {len(bcm.reported)}",
            f"{len(ref.booted)} / {len(ref.reported)}",
        ),
        ("moved (GiB)", f"{b['gib']:.1f}", f"{r['gib']:.1f}"),
        ("bytes/s, first request → last byte (MiB/s)", f"{b['mibs']:,.0f}", f"{r['mibs']:,.0f}"),
        ("artifact bytes/s, to the last artifact byte", f"{b['image_mibs']:,.0f}", f"{r['image_mibs']:,.0f}"),
        ("busy answers (503, retried)", str(bcm.busy), str(ref.busy)),
        ("failures (goal 0)", str(sum(bcm.failures.values())), str(sum(ref.failures.values()))),
        ("client CPU (s)", f"{client_cpu[0]:.1f}", f"{client_cpu[1]:.1f}"),
    ]
    print(f"  {'':44s} {'bcm':>16s}   {'nginx + peer':>16s}")
    for label, x, y in rows_:
        print(f"  {label:44s} {x:>16s}   {y:>16s}")
    print(
        f"  bcm/nginx bytes/s = {b['mibs'] / r['mibs']:.2f}x (goal >= 0.9x); all booted: bcm "
        f"{b['booted'] / r['booted']:.2f}x nginx's time"
    )
    print(
        f"  artifacts alone (the files both serve; the span ends at the last kernel/initramfs/root byte, before "
        f"the last callbacks): bcm/nginx = {b['image_mibs'] / r['image_mibs']:.2f}x"
    )
    for run in (bcm, ref):
        for what, count in run.failures.most_common(8):
            print(f"  {run.label} failure: {count} x {what}")
        for sample in run.samples:
            print(f"    e.g. {sample}")
    why = (
        (
            " (unreachable: the SSH inventory bcm starts after each callback finds no sshd at a simulated "
            "machine's address)"
        )
        if states.get("unreachable")
        else ""
    )
    print(f"  bcm's nodes after the run: {dict(states)}{why}")
    kid = (
        f" (+ {len(kids)} child processes, peak {max(kids.values()) / 1024:.0f} MiB each at most)"
        if kids
        else ""
    )
    print(f"  bcm server peak RSS (VmHWM): {hwm / 1024:.0f} MiB{kid}")
    top = ", ".join(f"{t} {c}" for t, c in sorted(rows.items(), key=lambda kv: -kv[1])[:8])
    print(f"  database rows: {sum(rows.values()):,} in {len(rows)} tables ({top})")


if __name__ == "__main__":
    main()
