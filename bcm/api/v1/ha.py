"""/api/v1/ha: the servers on this database, the leader and its epoch, the operations each holds."""

from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import select as sa_select
from sqlmodel import Session, col, select

from bcm.api.deps import SessionDep, Viewer
from bcm.models.ha import (
    LEASE_ROW,
    HaStatus,
    HeldOperation,
    Leader,
    LeaseStatus,
    Server,
    ServerStatus,
    ThisServer,
)
from bcm.models.operation import Operation, OpState
from bcm.workers import leader

router = APIRouter(prefix="/ha", tags=["ha"])
MAX_OPERATIONS = 1000


def _held(session: Session) -> list[HeldOperation]:
    """Open operations and who holds them (the work engine's ``owner`` lease, else the older ``runner``)."""
    table = Operation.__table__.c  # type: ignore[attr-defined]
    owner = table.get("owner", table.get("runner"))
    until = table.get("lease_expires", table.get("heartbeat_at"))
    cols = [table.id, table.kind, table.state]
    cols += [owner] if owner is not None else []
    cols += [until] if until is not None else []
    rows = session.execute(
        sa_select(*cols)
        .where(col(Operation.state).in_([OpState.PENDING.value, OpState.RUNNING.value]))
        .order_by(col(Operation.id))
        .limit(MAX_OPERATIONS)
    ).all()
    out = []
    for r in rows:
        m = r._mapping
        out.append(
            HeldOperation(
                id=m["id"],
                kind=m["kind"],
                state=m["state"],
                owner=m.get(owner.name) if owner is not None else None,
                lease_expires=m.get(until.name) if until is not None else None,
            )
        )
    return out


@router.get("", response_model=HaStatus)
def status(request: Request, session: SessionDep, _t: Viewer) -> HaStatus:
    """Servers (address, version, heartbeat), the leader lease and its epoch, operations held."""
    ha = getattr(request.app.state, "ha", None)
    lease_s = request.app.state.settings.ha.lease_s
    now = leader.db_now(session)
    lease = session.get(Leader, LEASE_ROW)
    servers = list(session.exec(select(Server).order_by(col(Server.started_at))))
    operations = _held(session)
    current = lease.holder if lease is not None and lease.expires_at and lease.expires_at > now else None
    by_owner: dict[str, int] = {}
    for op in operations:
        if op.owner:
            by_owner[op.owner] = by_owner.get(op.owner, 0) + 1
    addresses = {s.id: s.address for s in servers}
    return HaStatus(
        now=now,
        this_server=ThisServer(**ha.status()) if ha is not None else None,
        leader=LeaseStatus(
            holder=current,
            epoch=lease.epoch if lease is not None else 0,
            acquired_at=lease.acquired_at if current and lease is not None else None,
            expires_at=lease.expires_at if current and lease is not None else None,
            address=addresses.get(current) if current else None,
        ),
        servers=[
            ServerStatus(
                id=s.id,
                address=s.address,
                version=s.version,
                started_at=s.started_at,
                heartbeat_at=s.heartbeat_at,
                alive=s.heartbeat_at > now - timedelta(seconds=3 * lease_s),
                leader=s.id == current,
                operations=by_owner.get(s.id, 0),
            )
            for s in servers
        ],
        operations=operations,
    )


probe = APIRouter(tags=["meta"])


@probe.get("/leaderz")
def leaderz(request: Request) -> JSONResponse:
    """200 while this server leads (its lease and epoch), else 503: for keepalived's check script, which
    moves the service address to the leader. No token and no database: this process's own election."""
    ha = getattr(request.app.state, "ha", None)
    if ha is None or not ha.leading:
        return JSONResponse({"leading": False}, status_code=503)
    return JSONResponse({"leading": True, "epoch": ha.epoch})
