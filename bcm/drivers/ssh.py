"""SSH to nodes: bounded fan-out, host key pinning, key install and file upload. The only asyncssh user.

Per-host outcomes are data (``HostResult.status``), never exceptions: one dead host never fails a
batch. Exceptions (from ``bcm.errors``) are raised only for things that are wrong on the server's
side (unreadable client key, malformed public key argument) or by ``HostResult.raise_for_status``
when a caller wants one host's failure as an error.

Host keys are pinned by bcm, not by ``~/.ssh/known_hosts``: each Target carries the OpenSSH line
stored for it, or None for "pin on first contact". The key is checked during key exchange, so a
changed key is refused before authentication (no password reaches an impostor) and before any
command runs. The key seen is returned in every result, so the caller can store it on first
contact or show it when it changed.

Retries and the adaptive fan-out (rules in :mod:`bcm.domain.fanout`): a connect-stage failure that
the head's own load can cause (timeout, reset, refused, no route) is tried again after a jittered
backoff, at most ``retries`` more times and never past the fan-out's deadline; authentication, host
key and command failures never are. ``run_many`` starts at the configured concurrency (the ceiling)
and halves it when connects time out or come close to the timeout, growing back on fast connects.
Each result says how many attempts it took.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import shlex
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import asyncssh

from bcm.domain.fanout import AimdLimit, RetryPolicy, fan_out_budget, is_transient
from bcm.drivers.fanout import Gate, fan_out
from bcm.errors import DriverError, FatalDriverError, InvalidInput, RetryableDriverError

log = logging.getLogger(__name__)

DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_COMMAND_TIMEOUT_S = 60.0
DEFAULT_CONCURRENCY = 128
DEFAULT_RETRIES = 3
DEFAULT_BACKOFF_S = 0.5
# A connect slower than this share of the connect timeout was close to failing: the fan-out backs off.
SLOW_CONNECT_FRACTION = 0.5


class HostStatus(StrEnum):
    OK = "ok"
    UNREACHABLE = "unreachable"  # refused, no route, name unknown, connection dropped
    AUTH_FAILED = "auth_failed"  # the node does not accept our key (or password)
    TIMED_OUT = "timed_out"  # connect or command exceeded its bound
    HOST_KEY_CHANGED = "host_key_changed"  # the node's key differs from the pinned one
    COMMAND_FAILED = "command_failed"  # connected fine; the command exited non-zero


# Retrying may cure these; the others need an operator.
_RETRYABLE = {HostStatus.UNREACHABLE, HostStatus.TIMED_OUT}


@dataclass(frozen=True)
class Target:
    """One host to reach; ``pinned_host_key`` is an OpenSSH public key line or None (pin on first contact)."""

    name: str
    address: str
    port: int = 22
    pinned_host_key: str | None = None


@dataclass
class HostResult:
    name: str
    status: HostStatus
    exit_status: int | None = None
    stdout: str = ""
    stderr: str = ""
    host_key: str | None = None  # the key the host presented, OpenSSH format, no comment
    error: str | None = None
    duration_s: float = 0.0
    attempts: int = 1  # connections tried, retries included
    earlier: list[str] = field(default_factory=list)  # "status: error" of each attempt before the last
    retryable: bool = False  # a connect-stage failure another attempt may cure (bcm.domain.fanout)

    @property
    def ok(self) -> bool:
        return self.status is HostStatus.OK

    def raise_for_status(self) -> None:
        """Turn a failed result into the bcm error a single-host caller wants."""
        if self.ok:
            return
        message = f"{self.name}: {self.status.value}: {self.error or 'no detail'}"
        if self.status in _RETRYABLE:
            raise RetryableDriverError(message)
        if self.status is HostStatus.COMMAND_FAILED:
            raise DriverError(message)
        raise FatalDriverError(message)


@dataclass(frozen=True)
class RemoteFile:
    content: bytes
    mode: int = 0o644


OnResult = Callable[[HostResult], object | Awaitable[object]]


def public_key_line(key: asyncssh.SSHKey) -> str:
    """A key as one OpenSSH line without comment, the form pins are stored and compared in."""
    algorithm, data = key.export_public_key("openssh").decode().split()[:2]
    return f"{algorithm} {data}"


def parse_public_key(line: str, *, field_name: str = "public_key") -> asyncssh.SSHKey:
    try:
        return asyncssh.import_public_key(line.strip())
    except (asyncssh.KeyImportError, ValueError) as exc:
        raise InvalidInput(f"not an OpenSSH public key line: {exc}", field=field_name) from None


def ensure_keypair(path: Path | str, *, comment: str | None = None) -> str:
    """Create the server's ed25519 key pair on first use (dir 0700, key 0600); return the public line."""
    path = Path(path)
    if path.exists():
        try:
            key = asyncssh.read_private_key(path)
        except (OSError, asyncssh.KeyImportError) as exc:
            raise FatalDriverError(f"cannot read SSH key {path}: {exc}; fix or remove it") from None
        return public_key_line(key)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    key = asyncssh.generate_private_key("ssh-ed25519", comment=comment or f"bcm@{socket.gethostname()}")
    private = key.export_private_key("openssh")
    # O_EXCL: two server processes starting together must not both write (and mismatch) the key.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(private)
    try:
        os.link(tmp, path)
    except FileExistsError:
        tmp.unlink()
        return ensure_keypair(path)
    tmp.unlink()
    path.with_name(path.name + ".pub").write_bytes(key.export_public_key("openssh"))
    log.info("generated SSH key pair %s", path)
    return public_key_line(key)


class _PinningClient(asyncssh.SSHClient):
    """Records the host key offered; asyncssh calls this only for keys not already trusted."""

    def __init__(self, accept_unknown: bool) -> None:
        self.accept_unknown = accept_unknown
        self.seen_key: asyncssh.SSHKey | None = None

    def validate_host_public_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
        self.seen_key = key
        return self.accept_unknown


@dataclass
class _Attempt:
    """What one connection learnt, filled in as it goes so a timeout still reports it."""

    client: _PinningClient | None = None
    conn: asyncssh.SSHClientConnection | None = None
    connected: bool = False
    pinned: bool = False
    connect_started: float = 0.0

    def host_key(self) -> str | None:
        key = self.conn.get_server_host_key() if self.conn else None
        if key is None and self.client is not None:
            key = self.client.seen_key
        return public_key_line(key) if key is not None else None


class SshClient:
    """Connection settings built once (client key, user, timeouts, concurrency) for many calls."""

    def __init__(
        self,
        key_path: Path | str | None,
        *,
        username: str = "root",
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        command_timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S,
        concurrency: int = DEFAULT_CONCURRENCY,
        password: str | None = None,
        retries: int = DEFAULT_RETRIES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        rng: random.Random | None = None,
    ) -> None:
        keys: list[asyncssh.SSHKey] = []
        if key_path is not None:
            try:
                keys = [asyncssh.read_private_key(key_path)]
            except (OSError, asyncssh.KeyImportError) as exc:
                raise FatalDriverError(f"cannot read SSH client key {key_path}: {exc}") from None
        self.username = username
        self.connect_timeout_s = connect_timeout_s
        self.command_timeout_s = command_timeout_s
        self.concurrency = concurrency
        self.retry = RetryPolicy(attempts=1 + max(0, retries), backoff_s=backoff_s)
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not secrets
        # config=None and agent_path=None: only what bcm configures counts, never the invoking
        # user's ~/.ssh/config, agent keys or known_hosts.
        self._options = asyncssh.SSHClientConnectionOptions(
            username=username,
            client_keys=keys or None,
            password=password,
            preferred_auth="password,keyboard-interactive" if password else "publickey",
            agent_path=None,
            config=None,
            connect_timeout=connect_timeout_s,
            keepalive_interval=30,
            keepalive_count_max=3,
        )

    @classmethod
    def from_settings(cls, settings: Any) -> SshClient:
        """Build from ``bcm.settings.Settings`` (its ssh group and ssh_key_file)."""
        ssh = settings.ssh
        return cls(
            settings.ssh_key_file,
            username=ssh.username,
            connect_timeout_s=ssh.connect_timeout_s,
            command_timeout_s=ssh.command_timeout_s,
            concurrency=ssh.concurrency,
            retries=ssh.retries,
            backoff_s=ssh.backoff_s,
        )

    async def run_many(
        self,
        hosts: Sequence[Target],
        command: str,
        *,
        concurrency: int | None = None,
        connect_timeout: float | None = None,
        command_timeout: float | None = None,
        on_result: OnResult | None = None,
        stdin: str | None = None,
        deadline_s: float | None = None,
    ) -> list[HostResult]:
        """Run ``command`` on every host, at most ``concurrency`` at once; results in input order.

        ``concurrency`` (default: the client's) is the ceiling: fewer run at once while connects
        time out or slow down. Transient connect failures are retried until ``deadline_s`` from now
        (default :func:`~bcm.domain.fanout.fan_out_budget`, the work engine's bound for the batch).
        ``on_result`` is called (and awaited if it returns an awaitable) once per host as it
        finishes, always from this coroutine, one at a time, so it may use a single DB session.
        If it raises, the remaining hosts are cancelled and the exception propagates.
        """
        connect_s = connect_timeout or self.connect_timeout_s
        command_s = command_timeout or self.command_timeout_s
        ceiling = concurrency or self.concurrency
        budget = (
            deadline_s
            if deadline_s is not None
            else fan_out_budget(len(hosts), ceiling, connect_s, command_s)
        )
        deadline = time.monotonic() + budget
        control = AimdLimit(
            ceiling,
            slow_s=connect_s * SLOW_CONNECT_FRACTION,
            floor=min(ceiling, 4),
            increase=max(1.0, ceiling / 16),
        )
        gate = Gate(control)

        async def one(target: Target) -> HostResult:
            return await self._run_bounded(target, command, connect_s, command_s, stdin, gate, deadline)

        results = await fan_out(hosts, one, len(hosts), on_result)
        retried = sum(r.attempts - 1 for r in results)
        if retried or control.cuts:
            log.info(
                "ssh fan-out to %d hosts: %d retries, concurrency cut %d times (ceiling %d, lowest %d, now %d)",
                len(hosts),
                retried,
                control.cuts,
                ceiling,
                control.lowest,
                control.limit,
            )
        return results

    async def run_one(
        self,
        target: Target,
        command: str,
        *,
        connect_timeout: float | None = None,
        command_timeout: float | None = None,
        stdin: str | None = None,
    ) -> HostResult:
        """One host, with the same retries as ``run_many`` (deadline: one connect and one command timeout)."""
        connect_s = connect_timeout or self.connect_timeout_s
        command_s = command_timeout or self.command_timeout_s
        deadline = time.monotonic() + fan_out_budget(1, 1, connect_s, command_s)
        return await self._run_bounded(target, command, connect_s, command_s, stdin, None, deadline)

    async def put_files(
        self,
        target: Target,
        files: Mapping[str, bytes | RemoteFile],
        *,
        timeout: float | None = None,
    ) -> HostResult:
        """Write files on one host over one connection (``cat >`` into a temp file, then rename).

        Uses a shell rather than SFTP because minimal node images may ship sshd without the
        sftp subsystem; the rename makes each file appear whole or not at all.
        """
        for remote_path in files:
            if not remote_path.startswith("/") or "\0" in remote_path or "\n" in remote_path:
                raise InvalidInput(f"remote path must be absolute: {remote_path!r}", field="files")

        async def upload(conn: asyncssh.SSHClientConnection) -> HostResult:
            for remote_path, item in files.items():
                spec = item if isinstance(item, RemoteFile) else RemoteFile(item)
                path = shlex.quote(remote_path)
                tmp = shlex.quote(f"{remote_path}.bcm-tmp")
                script = (
                    f'umask 077 && mkdir -p -- "$(dirname -- {path})" && cat > {tmp} && '
                    f"chmod {spec.mode:o} {tmp} && mv -f -- {tmp} {path}"
                )
                done = await conn.run(script, input=spec.content, encoding=None, check=False)
                if done.exit_status != 0:
                    err = _text(done.stderr)
                    return HostResult(
                        target.name,
                        HostStatus.COMMAND_FAILED,
                        exit_status=done.exit_status,
                        stderr=err,
                        error=f"writing {remote_path} failed: {err.strip()[:200]}",
                    )
            return HostResult(target.name, HostStatus.OK, exit_status=0)

        command_s = timeout or self.command_timeout_s
        deadline = time.monotonic() + fan_out_budget(1, 1, self.connect_timeout_s, command_s)
        return await self._with_retries(target, self.connect_timeout_s, command_s, upload, None, deadline)

    async def _run_bounded(
        self,
        target: Target,
        command: str,
        connect_s: float,
        command_s: float,
        stdin: str | None,
        gate: Gate | None,
        deadline: float,
    ) -> HostResult:
        async def execute(conn: asyncssh.SSHClientConnection) -> HostResult:
            done = await conn.run(
                command, input=stdin, check=False, timeout=command_s, encoding="utf-8", errors="replace"
            )
            stdout, stderr = _text(done.stdout), _text(done.stderr)
            if done.exit_status == 0:
                return HostResult(target.name, HostStatus.OK, 0, stdout, stderr)
            why = (
                f"killed by signal {done.exit_signal[0]}"
                if done.exit_signal
                else f"exited {done.exit_status}"
            )
            tail = stderr.strip().splitlines()[-1:] if stderr.strip() else []
            return HostResult(
                target.name,
                HostStatus.COMMAND_FAILED,
                done.exit_status,
                stdout,
                stderr,
                error=f"command {why}" + (f": {tail[0][:200]}" if tail else ""),
            )

        return await self._with_retries(target, connect_s, command_s, execute, gate, deadline)

    async def _with_retries(
        self,
        target: Target,
        connect_s: float,
        command_s: float,
        work: Callable[[asyncssh.SSHClientConnection], Awaitable[HostResult]],
        gate: Gate | None,
        deadline: float,
    ) -> HostResult:
        """Attempts until one is not transient, the attempts are used up or the deadline is near.

        Each attempt holds a slot of ``gate`` (if any); the backoff between attempts holds none.
        """
        started = time.monotonic()
        attempts = 0
        earlier: list[str] = []
        while True:  # bounded: next_delay is None once self.retry.attempts are used
            attempts += 1
            if gate is not None:
                async with gate:
                    result = await self._with_connection(target, connect_s, command_s, work, gate.control)
            else:
                result = await self._with_connection(target, connect_s, command_s, work)
            wait = self.retry.next_delay(
                attempts, result.retryable, time.monotonic(), deadline, connect_s, self._rng
            )
            if wait is None:
                break
            earlier.append(f"{result.status.value}: {result.error}")
            log.debug(
                "ssh %s: attempt %d %s (%s); again in %.1fs",
                target.name,
                attempts,
                result.status.value,
                result.error,
                wait,
            )
            await asyncio.sleep(wait)
        result.attempts, result.earlier = attempts, earlier
        result.duration_s = time.monotonic() - started
        if attempts > 1 and not result.ok:
            result.error = f"{result.error or 'no detail'} (after {attempts} attempts)"
        return result

    async def _with_connection(
        self,
        target: Target,
        connect_s: float,
        command_s: float,
        work: Callable[[asyncssh.SSHClientConnection], Awaitable[HostResult]],
        control: AimdLimit | None = None,
    ) -> HostResult:
        """One attempt: connect, ``work``, close; reports the connect's latency or congestion to ``control``."""
        started = time.monotonic()
        attempt = _Attempt(connect_started=started)
        try:
            # One bound around everything: a host whose sshd accepts TCP and then stalls (or a
            # command that never ends) costs at most connect + command time, never the batch.
            result = await asyncio.wait_for(
                self._connect_and(target, attempt, connect_s, work, control), connect_s + command_s
            )
        except Exception as exc:  # every failure becomes this host's status, never the batch's
            result = _classify(target, attempt, exc, connect_s, command_s)
            result.retryable = is_transient(result.status.value, attempt.connected)
            if control is not None and not attempt.connected and _congestion(exc):
                control.on_congestion(attempt.connect_started, time.monotonic())
        finally:
            if attempt.conn is not None:
                attempt.conn.abort()
        if result.host_key is None:
            result.host_key = attempt.host_key()
        result.duration_s = time.monotonic() - started
        log.debug("ssh %s: %s in %.2fs", target.name, result.status.value, result.duration_s)
        return result

    async def _connect_and(
        self,
        target: Target,
        attempt: _Attempt,
        connect_s: float,
        work: Callable[[asyncssh.SSHClientConnection], Awaitable[HostResult]],
        control: AimdLimit | None,
    ) -> HostResult:
        trusted: list[asyncssh.SSHKey] = []
        if target.pinned_host_key:
            trusted = [parse_public_key(target.pinned_host_key, field_name="pinned_host_key")]
        attempt.pinned = bool(trusted)

        def factory() -> _PinningClient:
            attempt.client = _PinningClient(accept_unknown=not trusted)
            return attempt.client

        attempt.connect_started = time.monotonic()
        conn = await asyncssh.connect(
            target.address,
            target.port,
            options=self._options,
            known_hosts=(trusted, [], []),
            client_factory=factory,
            connect_timeout=connect_s,
        )
        attempt.conn = conn
        attempt.connected = True
        if control is not None:
            now = time.monotonic()
            control.on_connect(attempt.connect_started, now - attempt.connect_started, now)
        try:
            return await work(conn)
        finally:
            conn.close()


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _congestion(exc: BaseException) -> bool:
    """A connect that failed the way an overloaded head or node fails it: timed out, reset or dropped."""
    if isinstance(exc, asyncio.TimeoutError | TimeoutError | ConnectionResetError | BrokenPipeError):
        return True
    return isinstance(exc, asyncssh.ConnectionLost)


def _classify(
    target: Target, attempt: _Attempt, exc: BaseException, connect_s: float, command_s: float
) -> HostResult:
    """Map one host's exception to a status; the message never includes credentials."""

    def result(status: HostStatus, message: str, **kw: Any) -> HostResult:
        return HostResult(target.name, status, error=message, **kw)

    if isinstance(exc, InvalidInput):
        return result(HostStatus.HOST_KEY_CHANGED, f"stored host key is unusable: {exc.message}")
    if isinstance(exc, asyncssh.HostKeyNotVerifiable):
        return result(HostStatus.HOST_KEY_CHANGED, "host key differs from the pinned key; refused")
    if isinstance(exc, asyncssh.KeyExchangeFailed) and attempt.pinned:
        # With a pin, only the pinned key's algorithms are offered; a host that has none of
        # them has changed its key type.
        return result(HostStatus.HOST_KEY_CHANGED, f"host offers no key of the pinned type: {exc.reason}")
    if isinstance(exc, asyncssh.PermissionDenied):
        return result(HostStatus.AUTH_FAILED, f"authentication as {_user(attempt)} refused")
    if isinstance(exc, asyncssh.TimeoutError):  # conn.run's own bound: keep what was printed so far
        return result(
            HostStatus.TIMED_OUT,
            f"command exceeded {command_s:g}s",
            stdout=_text(exc.stdout),
            stderr=_text(exc.stderr),
        )
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        stage = f"command exceeded {command_s:g}s" if attempt.connected else f"no SSH login in {connect_s:g}s"
        return result(HostStatus.TIMED_OUT, stage)
    if isinstance(exc, asyncssh.DisconnectError):
        return result(HostStatus.UNREACHABLE, f"SSH disconnected: {exc.reason}")
    if isinstance(exc, asyncssh.ChannelOpenError):
        return result(HostStatus.UNREACHABLE, f"SSH session refused: {exc.reason}")
    if isinstance(exc, OSError):
        return result(HostStatus.UNREACHABLE, f"{exc.strerror or type(exc).__name__} ({target.address})")
    log.warning("ssh %s: unexpected %s", target.name, type(exc).__name__, exc_info=exc)
    return result(HostStatus.UNREACHABLE, f"unexpected {type(exc).__name__}: {exc}")


def _user(attempt: _Attempt) -> str:
    conn = attempt.conn
    return str(conn.get_extra_info("username")) if conn is not None else "the configured user"


_INSTALL_KEY_SCRIPT = (
    # Two sessions may add the same key to one file at once (two names for one host, two trust runs):
    # the check and the append happen under flock on the file, where the host has flock (util-linux).
    "umask 077; key=$(cat); mkdir -p ~/.ssh && exec 9>>~/.ssh/authorized_keys && "
    "{ if command -v flock >/dev/null 2>&1; then flock -w 30 9; fi; } && "
    '{ grep -qxF -- "$key" ~/.ssh/authorized_keys || printf \'%s\\n\' "$key" >&9; }'
)


async def install_public_key(
    target: Target,
    password: str,
    public_key: str,
    *,
    username: str = "root",
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    command_timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S,
) -> HostResult:
    """Log in with a password once and append ``public_key`` to authorized_keys (idempotent).

    For ``bcm node trust --password-stdin``. The host key rules are the same as for commands, so
    the password is only ever sent to a host whose key matches its pin (or on first contact).
    """
    key_line = public_key_line(parse_public_key(public_key))
    client = SshClient(
        None,
        username=username,
        connect_timeout_s=connect_timeout_s,
        command_timeout_s=command_timeout_s,
        password=password,
    )
    # The key travels on stdin, so no quoting of it into the command line is needed.
    return await client.run_one(target, _INSTALL_KEY_SCRIPT, stdin=key_line + "\n")


async def install_public_key_many(
    targets: Sequence[Target],
    password: str,
    public_key: str,
    *,
    username: str = "root",
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    command_timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S,
    concurrency: int = DEFAULT_CONCURRENCY,
    retries: int = DEFAULT_RETRIES,
    backoff_s: float = DEFAULT_BACKOFF_S,
) -> list[HostResult]:
    """``install_public_key`` on many hosts through ``run_many``: the same retries and adaptive fan-out."""
    key_line = public_key_line(parse_public_key(public_key))
    client = SshClient(
        None,
        username=username,
        connect_timeout_s=connect_timeout_s,
        command_timeout_s=command_timeout_s,
        concurrency=concurrency,
        password=password,
        retries=retries,
        backoff_s=backoff_s,
    )
    return await client.run_many(targets, _INSTALL_KEY_SCRIPT, stdin=key_line + "\n")
