"""Node agents: per-node tokens, and deploying the GPU health agent to nodes over SSH.

A node's agent token (role ``node``) is shown once; issuing a new one revokes the old one. ``deploy``
uploads the self-contained agent bundle (it needs only the node's python3), writes its config (server
URL, the node's own token, interval) with mode 0600 and starts it: as a systemd unit where systemd runs,
otherwise as a supervised background process (a small shell loop that restarts it), as in the lab.
The new token replaces the old one only once the agent on that node is running with it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
from dataclasses import dataclass
from typing import Any

import anyio
from sqlalchemy import func, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bcm.db import session_scope
from bcm.drivers import ssh
from bcm.errors import InvalidInput
from bcm.models.auth import ApiToken, Role
from bcm.models.base import utcnow
from bcm.models.gpu import Gpu
from bcm.models.node import Node
from bcm.services import auth, events, tls
from bcm.services import nodes as node_svc
from bcm.services import operations as op_svc
from bcm.settings import Settings

log = logging.getLogger("bcm.agents")

AGENT_DIR = "/opt/bcm"
BUNDLE_PATH = f"{AGENT_DIR}/bcm-agent.pyz"
SUPERVISOR_PATH = f"{AGENT_DIR}/bcm-agent-supervise"
CONFIG_PATH = "/etc/bcm/agent.json"
FIXTURE_PATH = "/etc/bcm/nvml-fixture.json"
PIDFILE = "/run/bcm-agent.pid"
LOGFILE = "/var/log/bcm-agent.log"
UNIT_PATH = "/etc/systemd/system/bcm-agent.service"
CA_PATH = "/etc/bcm/ca.pem"  # bcm's API CA, pushed over the pinned SSH connection with an https server_url


def _revoke_node_tokens(session: Session, node_id: int, keep: int | None = None) -> None:
    stmt = update(ApiToken).where(col(ApiToken.node_id) == node_id, col(ApiToken.revoked_at).is_(None))
    if keep is not None:
        stmt = stmt.where(col(ApiToken.id) != keep)
    session.execute(stmt.values(revoked_at=utcnow()))


def issue_node_token(
    session: Session, name: str, actor: str, *, revoke_old: bool = True
) -> tuple[ApiToken, str]:
    """A fresh agent token for node ``name``; with ``revoke_old`` the previous ones stop working now."""
    node = node_svc.get(session, name)
    assert node.id is not None
    row, secret = auth.issue(session, f"agent:{name}", Role.NODE, node_id=node.id)
    if revoke_old:
        _revoke_node_tokens(session, node.id, keep=row.id)
    # the token's id and name only: an event shows no character of the secret
    events.record(session, actor, "node.token", name, f"agent token #{row.id} ({row.name}) issued")
    session.flush()
    return row, secret


# --- deploy -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeploySpec:
    server_url: str
    interval_s: float
    nvml_fixture: dict[str, Any] | None = None  # lab only: the agent answers from this fake NVML


@dataclass
class _Plan:
    name: str
    node_id: int
    target: ssh.Target
    token_id: int
    secret: str
    expected_gpus: int | None


SUPERVISOR = """#!/bin/sh
# bcm-agent supervisor: restarts the agent when it exits; stop it with: kill "$(cat {pidfile})"
echo $$ > {pidfile}
child=
trap '[ -n "$child" ] && kill "$child" 2>/dev/null; rm -f {pidfile}; exit 0' TERM INT
while :; do
    python3 {bundle} --config {config} {args} &
    child=$!
    wait "$child"
    sleep 5
done
"""

UNIT = """[Unit]
Description=bcm GPU health agent
After=network-online.target

[Service]
ExecStart=/usr/bin/env python3 {bundle} --config {config} {args}
Restart=always
RestartSec=5

[Install]
WantedBy=multi-user.target
"""

# systemd where it runs (PID 1 is systemd); otherwise stop any old supervisor and start a new one,
# detached from the SSH session (setsid, no inherited descriptors).
START = """# bcm: start the bcm agent
set -e
command -v python3 >/dev/null || {{ echo "python3 is not installed on this node" >&2; exit 3; }}
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
    cat > {unit_path} <<'UNIT'
{unit}UNIT
    systemctl daemon-reload
    systemctl enable bcm-agent >/dev/null 2>&1 || true
    systemctl restart bcm-agent
    echo systemd
else
    if [ -f {pidfile} ] && kill -0 "$(cat {pidfile})" 2>/dev/null; then
        kill "$(cat {pidfile})" || true
        for i in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$(cat {pidfile} 2>/dev/null)" 2>/dev/null || break; sleep 0.5; done
    fi
    setsid sh {supervisor} </dev/null >>{logfile} 2>&1 &
    for i in 1 2 3 4 5 6 7 8 9 10; do [ -f {pidfile} ] && break; sleep 0.2; done
    echo supervised
fi
"""


def start_script(with_fixture: bool) -> tuple[str, bytes]:
    """The shell that starts the agent, and the supervisor script's bytes."""
    args = f"--fake {FIXTURE_PATH}" if with_fixture else ""
    fmt = {"bundle": BUNDLE_PATH, "config": CONFIG_PATH, "args": args, "pidfile": PIDFILE}
    unit = UNIT.format(**fmt)
    script = START.format(
        unit_path=UNIT_PATH,
        unit=unit,
        pidfile=PIDFILE,
        supervisor=shlex.quote(SUPERVISOR_PATH),
        logfile=LOGFILE,
    )
    return script, SUPERVISOR.format(**fmt).encode()


def agent_config(spec: DeploySpec, secret: str, expected_gpus: int | None, *, with_ca: bool = False) -> bytes:
    config: dict[str, Any] = {
        "server_url": spec.server_url.rstrip("/"),
        "token": secret,
        "interval_s": spec.interval_s,
        "expected_gpus": expected_gpus,
    }
    if with_ca:
        config["ca_file"] = CA_PATH
    return json.dumps(config, indent=2).encode()


def ca_for(settings: Settings, spec: DeploySpec) -> bytes | None:
    """The CA an agent with an https ``server_url`` verifies bcm against, where bcm publishes one."""
    if not (settings.tls.enabled and spec.server_url.startswith("https://")):
        return None
    path = tls.published_ca(settings)
    return path.read_bytes() if path is not None else None


def check_spec(spec: DeploySpec) -> None:
    if not spec.server_url.startswith(("http://", "https://")):
        raise InvalidInput("server_url: must start with http:// or https://", field="server_url")
    if spec.interval_s <= 0:
        raise InvalidInput("interval_s: must be > 0", field="interval_s")


def _plan(
    engine: Engine, settings: Settings, names: list[str], actor: str
) -> tuple[list[_Plan], dict[str, str]]:
    """Issue (without revoking the old ones yet) a token per reachable node; nodes with no address are skipped."""
    from bcm.services.inventory import load_targets

    targets, missing = load_targets(engine, names)
    plans: list[_Plan] = []
    with session_scope(engine) as s:
        for t in targets:
            node = node_svc.get(s, t.name)
            assert node.id is not None
            count = s.exec(select(func.count()).where(col(Gpu.node_id) == node.id)).one()
            row, secret = issue_node_token(s, t.name, actor, revoke_old=False)
            assert row.id is not None
            plans.append(
                _Plan(
                    t.name,
                    node.id,
                    ssh.Target(t.name, t.address, settings.ssh.port, t.pinned_key),
                    row.id,
                    secret,
                    int(count) if node.inventoried_at is not None else None,
                )
            )
    return plans, missing


async def _deploy_one(
    client: ssh.SshClient, plan: _Plan, spec: DeploySpec, bundle: bytes, ca: bytes | None
) -> ssh.HostResult:
    script, supervisor = start_script(spec.nvml_fixture is not None)
    config = agent_config(spec, plan.secret, plan.expected_gpus, with_ca=ca is not None)
    files: dict[str, bytes | ssh.RemoteFile] = {
        BUNDLE_PATH: ssh.RemoteFile(bundle, 0o755),
        SUPERVISOR_PATH: ssh.RemoteFile(supervisor, 0o755),
        CONFIG_PATH: ssh.RemoteFile(config, 0o600),
    }
    if ca is not None:
        files[CA_PATH] = ssh.RemoteFile(ca, 0o644)
    if spec.nvml_fixture is not None:
        files[FIXTURE_PATH] = ssh.RemoteFile(json.dumps(spec.nvml_fixture).encode(), 0o600)
    put = await client.put_files(plan.target, files)
    if not put.ok:
        return put
    return await client.run_one(plan.target, script)


def _settle(engine: Engine, plan: _Plan, result: ssh.HostResult, actor: str) -> dict[str, Any]:
    """Keep the new token where the agent started (revoke the old ones), else revoke the new one."""
    with session_scope(engine) as s:
        node = s.get(Node, plan.node_id)
        if result.ok:
            _revoke_node_tokens(s, plan.node_id, keep=plan.token_id)
            if node is not None and node.ssh_host_key is None and result.host_key:
                node.ssh_host_key = result.host_key  # pinned on first contact, as inventory does
                s.add(node)
            how = result.stdout.strip().splitlines()[-1:] or ["started"]
            events.record(s, actor, "agent.deploy", plan.name, f"agent running ({how[0]})")
            return {"status": "ok", "message": f"agent running ({how[0]})"}
        token = s.get(ApiToken, plan.token_id)
        if token is not None:
            token.revoked_at = utcnow()
            s.add(token)
        message = result.error or result.stderr.strip()[-300:] or "failed"
        events.record(s, actor, "agent.deploy", plan.name, message, severity="error")
        return {"status": result.status.value, "message": message}


async def deploy(
    engine: Engine, settings: Settings, op_id: int, names: list[str], spec: DeploySpec, actor: str
) -> None:
    """The background job behind ``bcm agent deploy``: per-node results on operation ``op_id``."""
    from bcm.agent.bundle import build_bundle

    try:
        bundle = build_bundle(include_pynvml=True)
    except FileNotFoundError:
        bundle = build_bundle(include_pynvml=False)
    ca = ca_for(settings, spec)
    plans, missing = await anyio.to_thread.run_sync(_plan, engine, settings, names, actor)

    def record(results: dict[str, dict[str, Any]], finish: bool = False) -> None:
        with session_scope(engine) as s:
            op = op_svc.get(s, op_id)
            if op.started_at is None:
                op_svc.start(s, op)
            lines = "".join(f"{n}: {r['status']} {r.get('message', '')}\n" for n, r in results.items())
            op_svc.add_results(s, op, results, lines)
            if finish:
                op_svc.finish(s, op)

    await anyio.to_thread.run_sync(
        record, {n: {"status": "no_address", "message": why} for n, why in missing.items()}
    )
    client = ssh.SshClient.from_settings(settings)
    limit = asyncio.Semaphore(settings.ssh.concurrency)
    # record() reads, merges and writes the operation's results: one at a time, or a result is lost
    recording = asyncio.Lock()

    async def one(plan: _Plan) -> None:
        async with limit:
            result = await _deploy_one(client, plan, spec, bundle, ca)
        entry = await anyio.to_thread.run_sync(_settle, engine, plan, result, actor)
        async with recording:
            await anyio.to_thread.run_sync(record, {plan.name: entry})

    try:
        await asyncio.gather(*(one(p) for p in plans))
    finally:
        async with recording:
            await anyio.to_thread.run_sync(record, {}, True)
