"""Several ``bcm serve`` on one database: a leader elected through a lease row with a fencing epoch.

Every server answers the API, boot files and health reports. What must happen once runs on the leader
only: dnsmasq (DHCP/TFTP), the provisioning queue and its deadlines, GPU-health drains and staleness,
workload-manager sync, BMC power polling and audit pruning.

The lease is one row (``leader``, id 1). Every ``ha.lease_s / 3`` each server, in one transaction, says
it is alive (its ``server`` row) and compare-and-sets the lease under a row lock (``SELECT … FOR
UPDATE`` on PostgreSQL; SQLite has one server): the holder extends it; anyone takes it once it has
expired, adding one to ``epoch``. Times are the database's clock on PostgreSQL, so servers' clocks
need not agree.

Fencing: the leader's work runs in a context that carries its epoch. Every transaction begun in that
context (a thread from :func:`anyio.to_thread.run_sync` inherits it) first reads the lease row with a
share lock (:func:`fence`) and is refused (:class:`Fenced`) unless this server still holds that epoch;
the share lock keeps a takeover waiting until the write has committed. So a leader that was paused
(SIGSTOP, a VM freeze, a long GC) and wakes after another took over cannot write anything, before or
after it notices. A leader that cannot renew for ``0.9 × lease_s`` (its own clock, counted from the
start of its last good renewal) stops its work and dnsmasq by itself.

On SQLite a second ``bcm serve`` is refused at start (:func:`claim_sqlite`): an exclusive lock on
``<database>.server-lock`` held as long as the process lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import fcntl
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
from sqlalchemy import delete, event, text, update
from sqlalchemy.engine import Connection, Engine
from sqlmodel import Session, col, select

from bcm import __version__
from bcm.db import session_scope
from bcm.errors import BcmError, Conflict
from bcm.models.base import utcnow
from bcm.models.ha import LEASE_ROW, Leader, Server
from bcm.settings import Settings
from bcm.workers.identity import server_id
from bcm.workers.supervise import supervise

log = logging.getLogger("bcm.ha")

RENEWALS_PER_LEASE = 3
LOCAL_MARGIN = 0.9  # a leader stops its work this far into a lease it could not renew
TAKEOVER_DELAY = 0.5  # leases between taking over from a silent leader and starting dnsmasq
STOP_GRACE_S = 5.0  # leader work is given this long to stop before it is left behind
SERVER_FORGOTTEN_S = 3600.0  # a server row silent this long is removed by the leader

# (server id, epoch) while code runs as the leader's work; None elsewhere
_EPOCH: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "bcm_leader_epoch", default=None
)


class Fenced(Conflict):
    """A write of the leader's work refused: a newer leader holds the lease."""


# ---- fencing ------------------------------------------------------------------------------------------


def fence(conn: Connection | Session, holder: str, epoch: int) -> None:
    """Refuse (:class:`Fenced`) unless ``holder`` still holds lease ``epoch``; call inside the write's
    transaction. On PostgreSQL the lease row stays share-locked until that transaction ends, so no
    takeover can commit in between."""
    lock = " FOR SHARE" if _dialect(conn) == "postgresql" else ""
    row = conn.execute(text(f"SELECT holder, epoch FROM leader WHERE id = {LEASE_ROW}{lock}")).first()  # noqa: S608
    if row is None or row[0] != holder or int(row[1]) != epoch:
        now = f"{row[0]} holds epoch {row[1]}" if row is not None else "no lease row"
        raise Fenced(f"refused: this server's leader epoch {epoch} is over ({now})")


def fenced(session: Session, epoch: int) -> None:
    """:func:`fence` for this server: the check every leader-only write makes in its transaction."""
    fence(session, server_id(), epoch)


def _dialect(conn: Connection | Session) -> str:
    bind = conn.get_bind() if isinstance(conn, Session) else conn
    return bind.dialect.name


def leader_epoch() -> int | None:
    """The epoch the running code acts under as the leader's work (None: not leader work)."""
    held = _EPOCH.get()
    return held[1] if held is not None else None


_idle_ms = [0]  # PostgreSQL: a leader-work transaction left idle this long is ended by the server


@event.listens_for(Session, "after_begin")
def _fence_leader_work(_session: Session, _transaction: Any, connection: Connection) -> None:
    held = _EPOCH.get()
    if held is not None:
        if _idle_ms[0] and connection.dialect.name == "postgresql":
            # a leader frozen inside a transaction must not hold the lease row's share lock (and so keep
            # every other server from taking over) for longer than a lease
            connection.execute(text(f"SET LOCAL idle_in_transaction_session_timeout = {_idle_ms[0]}"))
        try:
            fence(connection, *held)
        except Fenced:
            _refused[0] += 1
            raise


_refused = [0]  # fenced transactions refused in this process


def refused_writes() -> int:
    return _refused[0]


# ---- one SQLite server --------------------------------------------------------------------------------

_sqlite_lock: int | None = None


def claim_sqlite(settings: Settings) -> None:
    """On SQLite, make this the only ``bcm serve`` of its database file, or raise one clear line."""
    global _sqlite_lock
    url = settings.effective_database_url
    if not url.startswith("sqlite") or "///" not in url:
        return
    path = url.split("///", 1)[-1].split("?", 1)[0]
    if not path or path == ":memory:":
        return
    lock = Path(path).with_name(Path(path).name + ".server-lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise BcmError(
            f"another bcm serve ({other}) is using the SQLite database {path}: SQLite keeps one server;"
            " run several on PostgreSQL (BCM_DATABASE_URL)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
    _sqlite_lock = fd  # held (and the lock with it) until the process ends


# ---- the lease ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lease:
    """What one election round saw: ``epoch`` is ours if we lead, else None."""

    epoch: int | None
    holder: str | None
    holder_epoch: int
    expires_at: datetime | None
    previous: str | None = None  # whose lease this round took over (it had not given it up)


def db_now(session: Session) -> datetime:
    """The database's clock on PostgreSQL (every server agrees on it); this host's on SQLite."""
    if _dialect(session) == "postgresql":
        value = session.execute(text("SELECT clock_timestamp()")).scalar_one()
        assert isinstance(value, datetime)
        return value
    return utcnow()


def elect(
    engine: Engine, me: str, address: str, lease_s: float, *, leading: bool, take: bool = False
) -> Lease:
    """One round, one transaction: heartbeat ``me`` and take or extend the lease if it is free or ours
    (or, with ``take``, whoever holds it: SQLite's one server at its start, its predecessor being dead)."""
    with session_scope(engine) as s:
        if _dialect(s) == "postgresql":
            # a round waits for the lease row at most a lease, and a server frozen inside its round (SIGSTOP,
            # a paused VM) holds the row's lock no longer than a lease: then the others can take over
            s.execute(text(f"SET LOCAL lock_timeout = {max(1, int(lease_s * 1000 * LOCAL_MARGIN))}"))
            s.execute(text(f"SET LOCAL idle_in_transaction_session_timeout = {max(1, int(lease_s * 1000))}"))
        now = db_now(s)
        beat = s.execute(update(Server).where(col(Server.id) == me).values(heartbeat_at=now, address=address))
        if not getattr(beat, "rowcount", 0):
            s.add(Server(id=me, address=address, version=__version__, started_at=now, heartbeat_at=now))
            s.flush()
        row = s.exec(select(Leader).where(col(Leader.id) == LEASE_ROW).with_for_update()).first()
        if row is None:  # made by the migration; made again if someone deleted it
            row = Leader(id=LEASE_ROW, epoch=0)
            s.add(row)
        expires = now + timedelta(seconds=lease_s)
        previous = None
        if row.holder == me:  # ours, expired or not: nobody took it meanwhile, so the epoch still stands
            row.expires_at = expires
        elif take or row.holder is None or row.expires_at is None or row.expires_at <= now:
            previous = row.holder
            row.holder, row.epoch, row.acquired_at, row.expires_at = me, row.epoch + 1, now, expires
            log.warning(
                "this server (%s) is now the leader, epoch %d%s",
                me,
                row.epoch,
                f", after {previous}" if previous else "",
            )
        else:
            return Lease(None, row.holder, row.epoch, row.expires_at)
        s.add(row)
        if leading:
            gone = now - timedelta(seconds=max(SERVER_FORGOTTEN_S, lease_s * 10))
            s.execute(delete(Server).where(col(Server.heartbeat_at) < gone))
        return Lease(row.epoch, me, row.epoch, expires, previous)


def resign(engine: Engine, me: str) -> None:
    """Give the lease up (if ours) and remove this server's row: another takes over at once."""
    with session_scope(engine) as s:
        s.execute(
            update(Leader)
            .where(col(Leader.id) == LEASE_ROW, col(Leader.holder) == me)
            .values(holder=None, expires_at=None)
        )
        s.execute(delete(Server).where(col(Server.id) == me))


# ---- dnsmasq on a leash -----------------------------------------------------------------------------------

# A process of its own (so a frozen or killed server cannot hold it back): every tick it looks at the
# beat file the leader touches at each good renewal; when the beat is older than the limit, or the server
# is gone, it stops every dnsmasq started with this server's config. So a leader paused by SIGSTOP (whose
# dnsmasq, in a session of its own, would go on answering DHCP) loses its dnsmasq before its lease can
# expire in the database, and a killed one's dnsmasq does not outlive it.
LEASH = r"""
import os, signal, sys, time
beat, conf, limit, parent = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
mark = ("--conf-file=" + conf).encode()

def stop_dnsmasq():
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if mark in argv and os.path.basename(argv[0]) == b"dnsmasq":
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

while True:
    time.sleep(min(0.1, limit / 10))
    gone = os.getppid() != parent
    try:
        stale = time.time() - os.stat(beat).st_mtime > limit
    except FileNotFoundError:
        stale = True
    if gone or stale:
        stop_dnsmasq()
    if gone:
        sys.exit(0)
"""


class Leash:
    """The watchdog process above, for this server's dnsmasq."""

    def __init__(self, settings: Settings, limit_s: float) -> None:
        from bcm.drivers import dnsmasq

        self.conf = dnsmasq.paths(settings).conf
        self.beat_file = settings.state_dir / "leader.beat"
        self.limit_s = limit_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def beat(self, at: float) -> None:
        """The lease was good at wall-clock time ``at`` (the start of the round that renewed it)."""
        self.beat_file.touch(exist_ok=True)
        os.utime(self.beat_file, (at, at))

    def start(self, at: float) -> None:
        if self.running:
            return
        self.beat(at)
        self.proc = subprocess.Popen(  # noqa: S603 - our own interpreter and script
            [
                sys.executable,
                "-c",
                LEASH,
                str(self.beat_file),
                str(self.conf),
                str(self.limit_s),
                str(os.getpid()),
            ],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )

    def stop(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.beat_file.unlink()
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
            self.proc = None


# ---- the leader's work in this process ------------------------------------------------------------------


def default_address(settings: Settings) -> str:
    if settings.ha.address:
        return settings.ha.address
    host = settings.host if settings.host not in ("0.0.0.0", "::", "") else socket.gethostname()
    return f"{host}:{settings.port}"


class Leadership:
    """This server's part in the election, and the leader-only work it runs while it leads.

    ``await start()`` in the lifespan runs the first round before the server answers (a lone server
    leads from its first request on, as before); ``await stop()`` stops the work, then resigns.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.engine: Engine = app.state.engine
        self.settings: Settings = app.state.settings
        self.me = server_id()
        self.address = default_address(self.settings)
        self.epoch: int | None = None  # ours while we lead
        self.seen: Lease | None = None  # the last round's view
        self.work: list[asyncio.Task[Any]] = []
        self._loop: asyncio.Task[None] | None = None
        self._deadline = 0.0  # loop time by which a renewal must succeed, while leading
        self._failing = False
        # On SQLite no other server can lead (claim_sqlite), so a late beat on a loaded machine is no reason
        # to stop DHCP: there the leash only stops dnsmasq when this server is gone.
        one_server = self.engine.dialect.name == "sqlite"
        self.leash = Leash(self.settings, float("inf") if one_server else self.lease_s * LOCAL_MARGIN)
        _idle_ms[0] = max(1, int(self.lease_s * 1000))
        self._good_wall = 0.0  # wall-clock start of the last round that renewed the lease
        self._first = True  # on SQLite (one server per file) the first round takes a dead predecessor's lease

    @property
    def leading(self) -> bool:
        return self.epoch is not None

    @property
    def lease_s(self) -> float:
        return self.settings.ha.lease_s

    async def start(self) -> None:
        await self._round()
        self._loop = asyncio.create_task(self._run(), name="bcm-leader-election")

    async def stop(self) -> None:
        """Stop electing, stop the leader work (bounded), then give the lease up."""
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop
            self._loop = None
        await self._step_down("the server is stopping", stopping=True)
        try:
            with anyio.fail_after(STOP_GRACE_S):
                await anyio.to_thread.run_sync(resign, self.engine, self.me, abandon_on_cancel=True)
        except Exception as exc:  # the database may be away: the lease then simply expires
            log.warning("could not give the leader lease up (%s); it expires by itself", type(exc).__name__)

    async def _run(self) -> None:
        interval = self.lease_s / RENEWALS_PER_LEASE
        while True:
            await asyncio.sleep(interval)
            await self._round()

    async def _round(self) -> None:
        loop = asyncio.get_running_loop()
        started, wall = loop.time(), time.time()
        if self.leading and started >= self._deadline:  # we slept or stalled past our own lease
            await self._step_down("the lease was not renewed in time")
        try:
            with anyio.fail_after(self.lease_s * LOCAL_MARGIN):
                lease = await anyio.to_thread.run_sync(
                    lambda: elect(
                        self.engine,
                        self.me,
                        self.address,
                        self.lease_s,
                        leading=self.leading,
                        take=self._first and self.engine.dialect.name == "sqlite",
                    ),
                    abandon_on_cancel=True,
                )
        except Exception as exc:
            if not self._failing:  # logged once per outage
                log.warning("leader lease round failed (%s); retrying", type(exc).__name__)
            self._failing = True
            if self.leading and loop.time() >= self._deadline:
                await self._step_down("the database could not be reached to renew the lease")
            return
        if self._failing:
            log.info("leader lease round succeeded again")
        self._failing = self._first = False
        self.seen = lease
        if lease.epoch is None:
            if self.leading:
                await self._step_down(f"{lease.holder} leads with epoch {lease.holder_epoch}")
            return
        self._deadline = started + self.lease_s * LOCAL_MARGIN
        self._good_wall = wall
        if self.epoch != lease.epoch:
            if self.leading:
                await self._step_down(f"epoch {self.epoch} replaced by {lease.epoch}")
            await self._become(lease.epoch, lease.previous)
        else:
            await self._reload_pxe()
        if getattr(self.app.state, "dhcp", None) is not None:
            if self.leash.running:
                self.leash.beat(wall)
            else:
                self.leash.start(wall)

    async def _become(self, epoch: int, previous: str | None = None) -> None:
        self.epoch = epoch
        ctx = contextvars.copy_context()
        ctx.run(_EPOCH.set, (self.me, epoch))
        task = asyncio.create_task(self._start_work(previous), name="bcm-leader-start", context=ctx)
        try:
            await task
        except Exception:
            log.exception("starting the leader's work failed")
        if previous is not None:  # a failover, not a start: the audit log says so
            await self._record(
                "ha.leader", f"leads with epoch {epoch} at {self.address}, after {previous}", epoch
            )

    async def _record(self, action: str, message: str, epoch: int) -> None:
        """An audit event written as the leader's work of ``epoch``: refused (fenced) once a newer leader
        holds the lease, so an old leader's word never lands."""
        from bcm.services import events

        def write() -> None:
            with session_scope(self.engine) as s:
                events.record(s, "bcm:ha", action, self.me, message, detail={"epoch": epoch})

        ctx = contextvars.copy_context()
        ctx.run(_EPOCH.set, (self.me, epoch))
        try:
            with anyio.fail_after(STOP_GRACE_S):
                await asyncio.create_task(
                    anyio.to_thread.run_sync(write, abandon_on_cancel=True), context=ctx
                )
        except Fenced as exc:
            log.warning("%s not recorded: %s", action, exc.message)
        except Exception as exc:
            log.warning("%s not recorded (%s)", action, type(exc).__name__)

    async def _start_work(self, previous: str | None = None) -> None:
        """In the leader's context: every task made here (and every thread they use) carries the epoch.

        After a takeover (``previous``: a holder that did not give the lease up) dnsmasq starts half a lease
        later, beyond the old leader's leash (0.9 lease after its last good renewal, which was at least a
        lease ago): a margin for a machine so loaded that the old leash is late."""
        from bcm.workers import audit, autojoin, power, provision
        from bcm.workers import wlm as wlm_worker

        app, engine, settings = self.app, self.engine, self.settings
        log.info(
            "leader work starts (epoch %s): dnsmasq, provisioning, health, WLM sync, power poll, pruning",
            self.epoch,
        )
        app.state.provisioner.start()
        app.state.health.start()
        wlm_sync = supervise(
            "workload-manager sync",
            lambda: wlm_worker.sync_all(engine, settings),
            settings.wlm.sync_interval_s,
            logger=wlm_worker.log,
        )
        joiner = autojoin.AutoJoin(engine, settings, app.state.runner)
        joins = supervise("zero-touch join", joiner.tick, autojoin.TICK_S, logger=autojoin.log)
        for name, coro in (
            ("bcm-wlm-sync", wlm_sync),
            ("bcm-autojoin", joins),
            ("bcm-power-poll", power.poll_loop(engine, settings)),  # supervised inside, as is pruning
            ("bcm-audit-prune", audit.loop(engine, settings)),
        ):
            self.work.append(asyncio.create_task(coro, name=name))
        if previous is None:
            await provision.reconfigure(app)  # dnsmasq, when PXE is enabled
            self._leash_dnsmasq()
        else:  # in a task of the leader's work: the election's rounds go on meanwhile
            self.work.append(asyncio.create_task(self._dnsmasq_later(), name="bcm-leader-dnsmasq"))

    async def _dnsmasq_later(self) -> None:
        from bcm.workers import provision

        await asyncio.sleep(self.lease_s * TAKEOVER_DELAY)
        if self.leading:
            await provision.reconfigure(self.app)
            self._leash_dnsmasq()

    def _leash_dnsmasq(self) -> None:
        """dnsmasq runs on a leash from its first moment (renewed by every good round after)."""
        if getattr(self.app.state, "dhcp", None) is not None:
            self.leash.start(self._good_wall)

    async def _step_down(self, why: str, *, stopping: bool = False) -> None:
        if self.epoch is None:
            return
        log.warning("this server stops leading (epoch %s): %s", self.epoch, why)
        epoch, self.epoch = self.epoch, None
        app = self.app
        tasks, self.work = self.work, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_GRACE_S)
        for stop in (app.state.health.stop, app.state.provisioner.stop, self._stop_dhcp):
            try:
                with anyio.fail_after(STOP_GRACE_S):
                    await stop()
            except Exception:
                log.exception("stopping the leader's work: %s failed", getattr(stop, "__qualname__", stop))
        await anyio.to_thread.run_sync(self.leash.stop)
        if not stopping:  # lost, not given up: say so as the old epoch (refused once another leads)
            await self._record("ha.step-down", f"stops leading: {why}", epoch)

    async def _stop_dhcp(self) -> None:
        dhcp, self.app.state.dhcp = getattr(self.app.state, "dhcp", None), None
        self.app.state.provisioner.dhcp = None
        if dhcp is not None:
            await dhcp.stop()

    async def _reload_pxe(self) -> None:
        """PXE enabled or changed through another server's API: the leader's dnsmasq follows."""
        from bcm.workers import provision

        before = self.settings.pxe
        try:
            await anyio.to_thread.run_sync(provision.load_config, self.engine, self.settings)
        except Exception as exc:
            log.warning("could not read the PXE settings (%s)", type(exc).__name__)
            return
        if self.settings.pxe != before and self.epoch is not None:
            ctx = contextvars.copy_context()
            ctx.run(_EPOCH.set, (self.me, self.epoch))
            await asyncio.create_task(provision.reconfigure(self.app), context=ctx)

    def status(self) -> dict[str, Any]:
        """This server's own view, for ``GET /api/v1/ha``."""
        return {
            "id": self.me,
            "address": self.address,
            "leading": self.leading,
            "epoch": self.epoch,
            "lease_s": self.lease_s,
            "refused_writes": refused_writes(),
        }


def leading(app: Any) -> bool:
    """Whether this server may run leader-only work (True where no election runs: a bare app in tests)."""
    ha = getattr(app.state, "ha", None)
    return ha is None or bool(ha.leading)
