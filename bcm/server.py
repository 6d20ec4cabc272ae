"""`bcm serve`: prepare the state directory and database, then run the API with uvicorn."""

from __future__ import annotations

import gc
import logging
import os

import uvicorn
from sqlalchemy.engine import Engine

from bcm import logs
from bcm.api.app import create_app
from bcm.db import make_engine, session_scope, upgrade
from bcm.drivers import ssh
from bcm.pathsend import PathsendProtocol, set_min_rate, size_pool
from bcm.services import auth, categories, secrets
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

    claim_sqlite(settings)  # one server per SQLite file: a second one stops here, with one line
    engine, token_file = prepare(settings)
    if token_file:
        log.warning("created the first admin token; it is in %s (mode 0600)", token_file)
    db = engine.url.render_as_string(hide_password=True)
    log.info("bcm serving on http://%s:%s, database %s", settings.host, settings.port, db)
    writers = settings.health.writer_processes(sqlite=engine.dialect.name == "sqlite")
    log.info("health reports written by %s", f"{writers} writer processes" if writers else "a server thread")
    if settings.pxe.enabled:  # a PXE setting dnsmasq would refuse stops the start, with one line
        from bcm.drivers import dnsmasq
        from bcm.services import pxe

        dnsmasq.Supervisor(settings, list).prepare(pxe.server_url(settings) + "/boot/v1/ipxe/boot.ipxe")
        log.info("PXE on %s (%s mode), boot scripts at %s", settings.pxe.interface, settings.pxe.mode,
                 pxe.server_url(settings))  # fmt: skip
    app = create_app(settings, engine)
    size_pool(settings.images.max_transfers)
    set_min_rate(settings.images.min_rate_bytes_s, settings.images.min_rate_window_s)
    tune_gc()
    proxy_headers, trusted = forwarding(settings)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=uvicorn_level,
        # JSON: uvicorn's loggers go to the root handler above (its own config would print plain text)
        log_config=None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG,
        access_log=False,
        http=PathsendProtocol,  # whole boot artifacts by sendfile(2) (bcm.pathsend)
        proxy_headers=proxy_headers,
        forwarded_allow_ips=trusted,
        # a request line may carry a long hostlist (8192 characters, percent-encoded up to 3 bytes each)
        h11_max_incomplete_event_size=64 * 1024,
        # SIGTERM: requests still running after this long are cancelled, so a stuck one (a body that never
        # ends, a stream) cannot hold the shutdown for ever; the lifespan's own steps are bounded too (#27)
        timeout_graceful_shutdown=max(1, round(settings.http.graceful_shutdown_s)),
    )
