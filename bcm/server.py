"""`bcm serve`: prepare the state directory and database, then run the API with uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import uvicorn
from sqlalchemy.engine import Engine

from bcm import logs
from bcm.api.app import create_app
from bcm.api.bootport import BootOnly
from bcm.db import make_engine, session_scope, upgrade
from bcm.drivers import ssh
from bcm.errors import InvalidInput
from bcm.pathsend import PathsendProtocol, set_min_rate
from bcm.services import auth, categories, secrets, tls
from bcm.settings import Settings

log = logging.getLogger("bcm.server")


def prepare(settings: Settings) -> tuple[Engine, str | None]:
    """State dir (0700), schema at head, first admin token. Returns the engine and a new token file."""
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(settings.state_dir, 0o700)
    engine = make_engine(settings.effective_database_url, settings.db)
    upgrade(engine)
    ssh.ensure_keypair(settings.ssh_key_file)  # nodes trust this key (images, `bcm node trust`)
    secrets.ensure_key(settings.state_dir)  # made now, so that it is there to copy to another head node
    with session_scope(engine) as session:
        token_file = auth.bootstrap_admin(session, settings.admin_token_file)
        categories.seed_defaults(session)
    return engine, token_file


# The cyclic garbage collector runs after every 700 net allocations by default, and a health report
# makes thousands of objects (a validated model per GPU) that live until their batch is written: at 50
# agents the collections cost three times the validation itself (measured: 1.35 ms of CPU per report's
# validation, 0.41 ms with these thresholds). Objects are still freed by reference counting at once;
# only cycles wait longer.
GC_THRESHOLDS = (100_000, 50, 1000)


def tune_gc() -> None:
    """Keep everything loaded at start out of the collector's scans; collect cycles less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def forwarding(settings: Settings) -> tuple[bool, list[str] | None]:
    """uvicorn's ``proxy_headers`` and ``forwarded_allow_ips``: X-Forwarded-* believed only from
    ``http.trusted_proxies`` (uvicorn's own default believes 127.0.0.1, so the client address would follow
    a header whenever anything on the head node relays a request)."""
    proxies = settings.http.proxies
    return (True, proxies) if proxies else (False, None)


def serve(settings: Settings) -> None:
    uvicorn_level = logs.configure(settings.log_level, settings.log_format)
    from bcm.workers.leader import claim_sqlite

    boot_sock = None
    if settings.tls.enabled:
        tls.check_settings(settings)  # an admin's unreadable or mismatched pair stops here, with one line
        boot_sock = _listen(settings.host, settings.tls.boot_port)  # so does a boot port in use
    claim_sqlite(settings)  # one server per SQLite file: a second one stops here, with one line
    engine, token_file = prepare(settings)
    if token_file:
        log.warning("created the first admin token; it is in %s (mode 0600)", token_file)
    server_tls = tls.prepare(settings, _pxe_address(engine, settings)) if settings.tls.enabled else None
    db = engine.url.render_as_string(hide_password=True)
    scheme = "https" if server_tls else "http"
    log.info("bcm serving on %s://%s:%s, database %s", scheme, settings.host, settings.port, db)
    if server_tls:
        ca = tls.load_pem_cert(server_tls.ca_pem, "CA") if server_tls.ca_pem else None
        log.info(
            "TLS with %s; %s; boot files (plain HTTP) on http://%s:%s",
            server_tls.cert_file,
            f"CA fingerprint {tls.fingerprint(ca)}" if ca else "no CA published (BCM_TLS__CA_FILE unset)",
            settings.host,
            settings.tls.boot_port,
        )
    writers = settings.health.writer_processes(sqlite=engine.dialect.name == "sqlite")
    log.info("health reports written by %s", f"{writers} writer processes" if writers else "a server thread")
    if settings.pxe.enabled:  # a PXE setting dnsmasq would refuse stops the start, with one line
        from bcm.drivers import dnsmasq
        from bcm.services import pxe

        dnsmasq.Supervisor(settings, list).prepare(pxe.server_url(settings) + "/boot/v1/ipxe/boot.ipxe")
        log.info(
            "PXE on %s (%s mode), boot scripts at %s",
            settings.pxe.interface,
            settings.pxe.mode,
            pxe.server_url(settings),
        )
    app = create_app(settings, engine)
    app.state.ca_pem = server_tls.ca_pem if server_tls else None
    transfers = settings.images.max_transfers
    if transfers is not None and transfers < settings.pxe.max_concurrent:
        log.warning(
            "images.max_transfers (%d) is below pxe.max_concurrent (%d): nodes bcm provisions at once "
            "will be refused image downloads (503) while others hold them",
            transfers,
            settings.pxe.max_concurrent,
        )
    set_min_rate(settings.images.min_rate_bytes_s, settings.images.min_rate_window_s)
    tune_gc()
    proxy_headers, trusted = forwarding(settings)
    options: dict[str, Any] = dict(
        log_level=uvicorn_level,
        # JSON: uvicorn's loggers go to the root handler above (its own config would print plain text)
        log_config=None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG,
        access_log=False,
        http=PathsendProtocol,  # whole boot artifacts by sendfile(2) (bcm.pathsend; plain TCP only)
        proxy_headers=proxy_headers,
        forwarded_allow_ips=trusted,
        # a request line may carry a long hostlist (8192 characters, percent-encoded up to 3 bytes each)
        h11_max_incomplete_event_size=64 * 1024,
        # SIGTERM: requests still running after this long are cancelled, so a stuck one (a body that never
        # ends, a stream) cannot hold the shutdown for ever; the lifespan's own steps are bounded too (#27)
        timeout_graceful_shutdown=max(1, round(settings.http.graceful_shutdown_s)),
    )
    if server_tls is None or boot_sock is None:
        uvicorn.run(app, host=settings.host, port=settings.port, **options)
        return
    api = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        ssl_certfile=str(server_tls.cert_file),
        ssl_keyfile=str(server_tls.key_file),
        ssl_ciphers=TLS12_CIPHERS,
        **options,
    )
    if not tls.is_admin_pair(settings):
        app.state.tls_renew = _renewer(settings, api, server_tls)
    api_url = tls.node_api_url(settings) or f"https://{settings.host}:{settings.port}"
    boot = uvicorn.Config(BootOnly(app, api_url), interface="asgi3", lifespan="off", **options)
    serve_pair(api, boot, boot_sock)


# TLS 1.2 suites (1.3 has its own, all AEAD): forward-secret AEAD only. uvicorn's default ("TLSv1") offers a
# TLS 1.2 client the CBC and SHA-1 suites of TLS 1.0's time.
TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:!aNULL:!eNULL"


def _renewer(
    settings: Settings, api: uvicorn.Config, server_tls: tls.ServerTls
) -> Callable[[], Awaitable[None]]:
    """After `bcm pxe enable` changed the PXE address: a certificate that names it, served from the next
    handshake on (the live SSL context loads it; connections already open keep theirs)."""

    async def renew() -> None:
        names = tls.default_names(settings)
        if await anyio.to_thread.run_sync(tls.ensure_server_cert, settings.tls_dir, names):
            assert api.ssl is not None  # loaded when the API server started
            api.ssl.load_cert_chain(str(server_tls.cert_file), str(server_tls.key_file))
            log.info("server certificate issued again for %s", ", ".join(names))

    return renew


def _pxe_address(engine: Engine, settings: Settings) -> str | None:
    """The PXE address as `bcm pxe enable` stored it (else the setting): the certificate names it."""
    from bcm.services import pxe

    with session_scope(engine) as session:
        return pxe.effective(settings, pxe.stored_config(session)).address


def _listen(host: str, port: int) -> socket.socket:
    """The boot port's socket, bound before anything starts: a port in use is one line, not a traceback."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InvalidInput(
            f"setting BCM_TLS__BOOT_PORT: cannot listen on {host}:{port} ({exc.strerror})",
            field="BCM_TLS__BOOT_PORT",
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Paired(uvicorn.Server):
    """uvicorn's server without signal handlers of its own: :func:`serve_pair` holds one for both."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def serve_pair(api_config: uvicorn.Config, boot_config: uvicorn.Config, boot_sock: socket.socket) -> None:
    """The API (TLS, with the lifespan: workers, dnsmasq) and the plain boot port in one process and loop.

    The boot port opens once the API's start-up is done; SIGINT/SIGTERM stop both, and the signal is raised
    again after both have shut down (what uvicorn does for one server), so a shutdown is never cut short."""
    api, boot = _Paired(api_config), _Paired(boot_config)
    captured: list[int] = []

    def on_signal(sig: int, frame: Any) -> None:
        captured.append(sig)
        api.handle_exit(sig, frame)
        boot.handle_exit(sig, frame)

    async def both() -> None:
        api_task = asyncio.create_task(api.serve())
        while not api.started and not api_task.done():
            await asyncio.sleep(0.05)
        if not api.started:
            boot_sock.close()
            await api_task
            return
        boot_task = asyncio.create_task(boot.serve(sockets=[boot_sock]))
        await asyncio.wait({api_task, boot_task}, return_when=asyncio.FIRST_COMPLETED)
        api.should_exit = boot.should_exit = True
        await asyncio.gather(api_task, boot_task)

    signals = (signal.SIGINT, signal.SIGTERM)
    originals: dict[int, Any] = {sig: signal.signal(sig, on_signal) for sig in signals}
    try:
        factory = getattr(api_config, "get_loop_factory", lambda: None)()  # uvloop where uvicorn picks it
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(both())
    finally:
        for sig, handler in originals.items():
            signal.signal(sig, handler)
    for sig in reversed(captured):
        signal.raise_signal(sig)
