"""dnsmasq for PXE: the only module that starts, configures or signals it.

``bcm serve`` (with ``pxe.enabled``) renders ``<state_dir>/pxe/dnsmasq.conf`` from ``templates/dnsmasq/``,
checks it with ``dnsmasq --test``, copies the two iPXE binaries (BIOS ``undionly.kpxe``, UEFI
``ipxe.efi``) into a TFTP root that holds nothing else, and keeps dnsmasq running in the foreground
(``--keep-in-foreground``): a dnsmasq that exits is started again after a back-off (1 s doubling to 30 s).
Known machines are one file each in ``hosts/`` (``dhcp-hostsdir``): dnsmasq reads a new or changed file
by itself, and is sent SIGHUP only when a file was removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bcm.errors import DriverError, InvalidInput
from bcm.services.render import render
from bcm.settings import Settings

log = logging.getLogger("bcm.dnsmasq")
IPXE_FILES = ("undionly.kpxe", "ipxe.efi")
BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 30.0
STOP_WAIT_S = 5.0
HEALTHY_AFTER_S = 30.0  # a dnsmasq that ran this long resets the back-off


@dataclass(frozen=True)
class Paths:
    root: Path

    @property
    def conf(self) -> Path:
        return self.root / "dnsmasq.conf"

    @property
    def hosts(self) -> Path:
        return self.root / "hosts"

    @property
    def tftp(self) -> Path:
        return self.root / "tftp"

    @property
    def pid(self) -> Path:
        return self.root / "dnsmasq.pid"

    @property
    def leases(self) -> Path:
        return self.root / "dnsmasq.leases"

    @property
    def log(self) -> Path:
        return self.root / "dnsmasq.log"


def paths(settings: Settings) -> Paths:
    return Paths(settings.state_dir / "pxe")


def context(settings: Settings, p: Paths, boot_url: str) -> dict[str, object]:
    """Everything the config template says, checked: a bad setting is an error naming it."""
    pxe = settings.pxe
    if not pxe.interface:
        raise InvalidInput(
            "pxe.interface: say which interface serves PXE (BCM_PXE__INTERFACE)", field="pxe.interface"
        )
    if not pxe.address:
        raise InvalidInput(
            "pxe.address: the head node's address on the PXE interface (BCM_PXE__ADDRESS)",
            field="pxe.address",
        )
    try:
        address = ipaddress.IPv4Address(pxe.address)
        network = ipaddress.IPv4Network(f"{address}/{pxe.netmask}", strict=False)
    except ValueError as exc:
        raise InvalidInput(f"pxe.address/pxe.netmask: {exc}", field="pxe.address") from None
    ctx: dict[str, object] = {
        "generated_by": "bcm serve",
        "interface": pxe.interface,
        "address": str(address),
        "network": str(network.network_address),
        "netmask": str(network.netmask),
        "mode": pxe.mode,
        "range_start": None,
        "range_end": None,
        "lease_time": pxe.lease_time,
        "router": pxe.router,
        "ipv6_ra": pxe.ipv6_ra,
        "hosts_dir": str(p.hosts),
        "tftp_root": str(p.tftp),
        "pid_file": str(p.pid),
        "lease_file": str(p.leases),
        "boot_url": boot_url,
    }
    if pxe.mode == "dhcp":
        for field in ("range_start", "range_end"):
            value = getattr(pxe, field)
            try:
                ip = ipaddress.IPv4Address(value or "")
            except ValueError:
                raise InvalidInput(
                    f"pxe.{field}: an IPv4 address in {network} (BCM_PXE__{field.upper()})",
                    field=f"pxe.{field}",
                ) from None
            if ip not in network or ip == address:
                raise InvalidInput(
                    f"pxe.{field}: {ip} is not a free address of {network}", field=f"pxe.{field}"
                )
            ctx[field] = str(ip)
        if ipaddress.IPv4Address(ctx["range_start"]) > ipaddress.IPv4Address(ctx["range_end"]):
            raise InvalidInput("pxe.range_start: the range starts after it ends", field="pxe.range_start")
    return ctx


def render_config(ctx: dict[str, object]) -> str:
    return render("dnsmasq/dnsmasq.conf.j2", **ctx)


def host_file_name(mac: str) -> str:
    return mac.replace(":", "-") + ".conf"


def render_host(mac: str, ip: str | None, node: str) -> str:
    return render("dnsmasq/host.j2", mac=mac, ip=ip, node=node)


def write_hosts(hosts_dir: Path, entries: list[tuple[str, str | None, str]]) -> tuple[int, int]:
    """Make ``hosts_dir`` hold exactly one file per entry; returns (written, removed)."""
    hosts_dir.mkdir(parents=True, exist_ok=True)
    wanted = {host_file_name(mac): render_host(mac, ip, node) for mac, ip, node in entries}
    written = removed = 0
    for name, text in wanted.items():
        path = hosts_dir / name
        with contextlib.suppress(FileNotFoundError):
            if path.read_text() == text:
                continue
        tmp = hosts_dir / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, path)  # dnsmasq sees a whole file or none (it skips dot files)
        written += 1
    for path in hosts_dir.glob("*.conf"):
        if path.name not in wanted:
            path.unlink(missing_ok=True)
            removed += 1
    return written, removed


def leased_addresses(leases: Path, mac: str) -> tuple[str, ...]:
    """The addresses dnsmasq's lease file gives ``mac`` (``expiry mac ip name client-id`` lines). One MAC can
    hold several: dnsmasq keys a lease by the client's identifier where it sends one, so iPXE (none) and the
    installed system's DHCP client (a DUID) each have their own lease for the same NIC."""
    try:
        lines = leases.read_text().splitlines()[:100_000]
    except FileNotFoundError:
        return ()
    found = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 3 and parts[1].lower() == mac and parts[2] not in found:
            found.append(parts[2])
    return tuple(found)


def prepare_tftp(ipxe_dir: Path, tftp: Path) -> None:
    """The TFTP root: the iPXE binaries and nothing else."""
    tftp.mkdir(parents=True, exist_ok=True)
    for name in IPXE_FILES:
        source = ipxe_dir / name
        if not source.is_file():
            raise DriverError(
                f"{source} is missing: install Debian's ipxe package (or set BCM_PXE__IPXE_DIR)"
            )
        target = tftp / name
        if not target.exists() or target.stat().st_size != source.stat().st_size:
            shutil.copyfile(source, tftp / f".{name}.tmp")
            os.replace(tftp / f".{name}.tmp", target)
    for extra in tftp.iterdir():
        if extra.name not in IPXE_FILES:
            if extra.is_dir():
                shutil.rmtree(extra)
            else:
                extra.unlink()


def binary(settings: Settings) -> str:
    found = shutil.which(settings.pxe.dnsmasq)
    if found is None:
        raise DriverError(f"{settings.pxe.dnsmasq} is not installed (Debian package dnsmasq-base)")
    return found


def check(dnsmasq: str, conf: Path) -> None:
    """``dnsmasq --test``: a config it would refuse is an error here, before anything is replaced."""
    try:
        out = subprocess.run(
            [dnsmasq, "--test", f"--conf-file={conf}"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DriverError(f"dnsmasq --test: {exc}") from None
    if out.returncode != 0:
        raise DriverError(f"dnsmasq refuses {conf}: {(out.stderr or out.stdout).strip()[:500]}")


def validate(settings: Settings, boot_url: str) -> None:
    """Render the config for ``settings`` and have dnsmasq check it, touching nothing in the state dir."""
    import tempfile

    text = render_config(context(settings, paths(settings), boot_url))
    with tempfile.TemporaryDirectory(prefix="bcm-dnsmasq-") as tmp:
        conf = Path(tmp) / "dnsmasq.conf"
        conf.write_text(text)
        check(binary(settings), conf)


class Supervisor:
    """Keeps one dnsmasq running for ``bcm serve``; ``sync`` rewrites the host files from the database."""

    def __init__(
        self, settings: Settings, load_entries: Callable[[], list[tuple[str, str | None, str]]]
    ) -> None:
        self.settings = settings
        self.paths = paths(settings)
        self._load_entries = load_entries  # () -> list[(mac, ip, name)], run in a worker thread
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._sync_lock = asyncio.Lock()

    def prepare(self, boot_url: str) -> None:
        """Render, check and write the config; copy the TFTP files (in a worker thread)."""
        ctx = context(self.settings, self.paths, boot_url)
        self.paths.root.mkdir(parents=True, exist_ok=True)
        self.paths.hosts.mkdir(exist_ok=True)
        prepare_tftp(self.settings.pxe.ipxe_dir, self.paths.tftp)
        tmp = self.paths.root / ".dnsmasq.conf.tmp"
        tmp.write_text(render_config(ctx))
        check(binary(self.settings), tmp)
        os.replace(tmp, self.paths.conf)

    async def start(self, boot_url: str) -> None:
        import anyio

        await anyio.to_thread.run_sync(self.prepare, boot_url)
        await self.sync()
        await self._spawn()
        self._task = asyncio.create_task(self._watch(), name="bcm-dnsmasq")

    async def _spawn(self) -> None:
        log_file = open(self.paths.log, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = await asyncio.create_subprocess_exec(
                binary(self.settings),
                "--keep-in-foreground",
                f"--conf-file={self.paths.conf}",
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                start_new_session=True,
            )
        finally:
            log_file.close()
        log.info("dnsmasq started (pid %s) on %s", self.proc.pid, self.settings.pxe.interface)

    async def _watch(self) -> None:
        backoff = BACKOFF_MIN_S
        while not self._stopping:
            started = asyncio.get_running_loop().time()
            rc = await self.proc.wait() if self.proc is not None else None
            if self._stopping:
                return
            ran = asyncio.get_running_loop().time() - started
            backoff = BACKOFF_MIN_S if ran > HEALTHY_AFTER_S else min(backoff * 2, BACKOFF_MAX_S)
            log.warning(
                "dnsmasq exited (status %s) after %.0f s; starting it again in %.0f s", rc, ran, backoff
            )
            await asyncio.sleep(backoff)
            if self._stopping:
                return
            try:
                await self._spawn()
                self.restarts += 1
            except Exception as exc:  # not installed any more …: try again after the next back-off
                log.error("dnsmasq did not start: %s", exc)
                self.proc = None

    async def sync(self) -> None:
        """Host files from the database; SIGHUP when one was removed (dnsmasq reads new ones itself)."""
        import anyio

        async with self._sync_lock:
            entries = await anyio.to_thread.run_sync(self._load_entries)
            _, removed = await anyio.to_thread.run_sync(write_hosts, self.paths.hosts, entries)
            if removed and self.proc is not None and self.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGHUP)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), STOP_WAIT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
