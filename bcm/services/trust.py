"""`bcm node trust`: install the server's SSH public key on nodes with a one-time root password."""

from __future__ import annotations

from typing import Any

import anyio
from sqlalchemy.engine import Engine
from sqlmodel import select

from bcm.db import session_scope
from bcm.drivers import ssh
from bcm.models.node import Node
from bcm.services import events
from bcm.services.inventory import load_targets
from bcm.settings import Settings


async def trust(
    engine: Engine, settings: Settings, names: list[str], password: str, actor: str
) -> dict[str, Any]:
    """Per-node results; the password is used once per node and never stored or logged."""
    targets, missing = await anyio.to_thread.run_sync(load_targets, engine, names)
    public_key = ssh.ensure_keypair(settings.ssh_key_file)
    # one fan-out with the others' retries of transient connect failures (never of a refused password)
    results = await ssh.install_public_key_many(
        [ssh.Target(t.name, t.address, settings.ssh.port, t.pinned_key) for t in targets],
        password,
        public_key,
        username=settings.ssh.username,
        connect_timeout_s=settings.ssh.connect_timeout_s,
        command_timeout_s=settings.ssh.command_timeout_s,
        concurrency=settings.ssh.concurrency,
        retries=settings.ssh.retries,
        backoff_s=settings.ssh.backoff_s,
    )

    def record() -> dict[str, Any]:
        out: dict[str, Any] = {n: {"status": "no_address", "message": why} for n, why in missing.items()}
        with session_scope(engine) as s:
            for r in results:
                node = s.exec(select(Node).where(Node.name == r.name)).one()
                if r.status == ssh.HostStatus.OK and node.ssh_host_key is None and r.host_key:
                    node.ssh_host_key = r.host_key  # pinned on first contact
                    s.add(node)
                out[r.name] = {"status": r.status.value, "message": r.error or ""}
                if r.attempts > 1:
                    out[r.name]["attempts"] = r.attempts
            oks = [n for n, r in out.items() if r["status"] == "ok"]
            events.record(
                s, actor, "node.trust", ",".join(sorted(out)), f"{len(oks)}/{len(out)} now trust bcm's key"
            )
        return out

    return await anyio.to_thread.run_sync(record)
