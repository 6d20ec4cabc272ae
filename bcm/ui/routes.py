"""The dashboard's pages (GET): Overview, Nodes, Node, Operations, Health, Images, Workload managers,
Tenancy, PXE; and signing in and out. Reads go through the services the API uses."""

from __future__ import annotations

import secrets
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Query, Request
from fastapi import Path as Path_
from fastapi.responses import Response
from sqlalchemy import select as sa_select
from sqlmodel import col

from bcm.api.deps import SessionDep
from bcm.api.limits import CONTROL_CHARS
from bcm.api.v1 import discovered as discovered_api
from bcm.domain.health import Verdict
from bcm.domain.naming import expand_hostlist
from bcm.domain.power import PowerAction
from bcm.domain.states import State
from bcm.errors import BcmError, InvalidInput, Unauthorized
from bcm.models.auth import Role
from bcm.models.health import GpuHealth
from bcm.models.node import Node
from bcm.models.operation import Operation
from bcm.models.wlm import WlmCluster
from bcm.services import auth, events, health_queries, images, tenancy, wlm, wlm_usage
from bcm.services import nodes as node_svc
from bcm.services import operations as op_svc
from bcm.ui import charts, queries
from bcm.ui import session as sessions
from bcm.ui.web import Me, UiRoute, check_csrf, read_form, redirect, render

router = APIRouter(prefix="/ui", route_class=UiRoute, include_in_schema=False)

VERB_ACTIONS = ("drain", "resume", "provision")
POWER_ACTIONS = tuple(
    f"power-{a.value}" for a in (PowerAction.ON, PowerAction.OFF, PowerAction.CYCLE, PowerAction.STATUS)
)
ACTIONS = VERB_ACTIONS + POWER_ACTIONS
Text = Annotated[str | None, Query(max_length=8192)]


def clean(value: str | None, field: str, max_length: int = 63) -> str | None:
    """A filter from a form: empty means none; control characters and overlong values are refused."""
    if value is None or value.strip() == "":
        return None
    value = value.strip()
    if len(value) > max_length or CONTROL_CHARS.search(value):
        raise InvalidInput(f"{field}: at most {max_length} printable characters", field=field)
    return value


# ---- signing in and out -----------------------------------------------------------------------------


def _safe_next(value: str | None) -> str:
    if value and value.startswith("/ui/") and not value.startswith("//") and "\\" not in value:
        return value if not CONTROL_CHARS.search(value) else "/ui/"
    return "/ui/"


def _secure(request: Request) -> bool:
    return request.url.scheme == "https"


def _signin_form(
    request: Request, message: str | None = None, status_code: int = 200, next_url: str = "/ui/"
) -> Response:
    nonce = secrets.token_hex(16)
    state_dir = request.app.state.settings.state_dir
    response = render(
        request,
        "ui/signin.html",
        {"csrf": sessions.csrf_token(state_dir, "signin|" + nonce), "message": message, "next": next_url},
        status_code,
    )
    response.set_cookie(
        sessions.LOGIN_COOKIE,
        nonce,
        max_age=3600,
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=_secure(request),
    )
    return response


@router.get("/signin")
def signin_page(request: Request, next: Text = None) -> Response:  # noqa: A002 - the query's name
    return _signin_form(request, next_url=_safe_next(next))


@router.post("/signin")
async def signin(request: Request, session: SessionDep) -> Response:
    form = await read_form(request)
    state_dir = request.app.state.settings.state_dir
    next_url = _safe_next(form.get("next"))
    nonce = request.cookies.get(sessions.LOGIN_COOKIE)
    if not nonce or not sessions.csrf_ok(state_dir, "signin|" + nonce, form.get("csrf")):
        return _signin_form(request, "The sign-in form expired; paste the token again.", 403, next_url)
    presented = (form.get("token") or "").strip()
    if not presented:
        return _signin_form(request, "Paste a token (bcm token create NAME --role viewer).", 400, next_url)
    try:
        token = auth.verify(session, presented)
    except Unauthorized as exc:
        client = request.client.host if request.client else "unknown"
        err = request.app.state.auth_failures.refusal(client, request.url.path, exc.message, exc)
        response = _signin_form(request, err.message, err.status_code, next_url)
        response.headers.update(err.headers())
        return response
    role = Role(token.role)
    if role is Role.NODE or role.rank < Role.VIEWER.rank:
        return _signin_form(
            request,
            f"A {role.value} token cannot sign in to the dashboard "
            "(it needs a viewer, operator or admin token).",
            403,
            next_url,
        )
    assert token.id is not None
    cookie, _ref = sessions.issue(state_dir, token.id)
    events.record(session, f"{token.role}:{token.name}", "ui.signin", token.name, "dashboard session started")
    response = redirect(next_url)
    response.set_cookie(
        sessions.COOKIE,
        cookie,
        max_age=sessions.LIFETIME_S,
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=_secure(request),
    )
    response.delete_cookie(sessions.LOGIN_COOKIE, path="/ui")
    return response


@router.post("/signout")
async def signout(request: Request, me: Me, session: SessionDep) -> Response:
    check_csrf(request, me, await read_form(request))
    sessions.signed_out.add(me.ref.nonce, me.ref.expires)
    events.record(session, me.actor, "ui.signout", me.token.name, "dashboard session ended")
    response = redirect("/ui/signin")
    response.delete_cookie(
        sessions.COOKIE, path="/ui", httponly=True, samesite="strict", secure=_secure(request)
    )
    return response


# ---- overview -----------------------------------------------------------------------------------------


@router.get("")
def root() -> Response:
    return redirect("/ui/")


@router.get("/")
def overview(request: Request, me: Me, session: SessionDep) -> Response:
    settings = request.app.state.settings
    summary = health_queries.summary(session, settings.health)
    sizes = queries.cluster_sizes(session)
    clusters = [(c, sizes.get(c.id or 0, 0)) for c in wlm.query(session)]
    current = [i for i in images.listing(session) if i.current]
    context = {
        "states": sorted(queries.states(session).items()),
        "summary": summary,
        "operations": queries.running_operations(session),
        "events": events.query(session, limit=12),
        "health_events": health_queries.events(session, limit=8),
        "clusters": clusters,
        "images": current,
    }
    return render(request, "ui/overview.html", context, etag=True)


# ---- nodes ----------------------------------------------------------------------------------------------


@router.get("/nodes")
def nodes_page(
    request: Request,
    me: Me,
    session: SessionDep,
    nodes: Text = None,
    state: Text = None,
    category: Text = None,
    health: Text = None,
    sort: Annotated[str, Query(max_length=16)] = "name",
    dir: Annotated[str, Query(pattern="^(asc|desc)$")] = "asc",  # noqa: A002
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    offset: Annotated[int, Query(ge=0, le=2_147_483_647)] = 0,
    done: Annotated[str | None, Query(max_length=32)] = None,
) -> Response:
    f = queries.NodeFilter(
        nodes=clean(nodes, "nodes", 8192),
        state=clean(state, "state", 16),
        category=clean(category, "category"),
        health=clean(health, "health", 16),
        sort=sort,
        desc=dir == "desc",
    )
    rows, total = queries.node_page(session, f, limit=limit, offset=offset)
    base = f.params() | ({"limit": str(limit)} if limit != 100 else {})

    def link(**change: Any) -> str:
        params = {**base, **{k: str(v) for k, v in change.items() if v is not None}}
        params = {k: v for k, v in params.items() if v not in ("", "0") or k == "offset" and v != "0"}
        return "/ui/nodes" + ("?" + urlencode(params) if params else "")

    def sort_link(column: str) -> str:
        desc = "desc" if f.sort == column and not f.desc else None
        return link(sort=column if column != "name" else None, dir=desc, offset=None)

    context = {
        "rows": rows,
        "total": total,
        "f": f,
        "limit": limit,
        "offset": offset,
        "states": [s.value for s in State],
        "categories": queries.categories(session),
        "verdicts": [v.value for v in Verdict],
        "actions": ACTIONS,
        "prev": link(offset=max(0, offset - limit)) if offset > 0 else None,
        "next": link(offset=offset + limit) if offset + limit < total else None,
        "sort_link": sort_link,
        "done": done if done in ACTIONS else None,
        "page_sizes": queries.PAGE_SIZES,
    }
    return render(request, "ui/nodes.html", context, etag=True)


@router.get("/nodes/{name}")
def node_page(request: Request, name: str, me: Me, session: SessionDep) -> Response:
    if len(name) > 63 or CONTROL_CHARS.search(name):
        raise InvalidInput("name: a node name", field="name")
    node = node_svc.get(session, name)
    view = node_svc.to_public(session, [node])[0]
    hardware = node_svc.hardware(session, name)
    gpus = health_queries.node_gpus(session, name)
    keep = request.app.state.settings.health.history_per_gpu
    readings = queries.node_readings(session, node.id or 0, keep)
    gpu_charts = {g.uuid: charts.gpu_charts(readings.get(g.uuid, [])) for g in gpus}
    samples = {g.uuid: len(readings.get(g.uuid, [])) for g in gpus}
    nh = {
        r.name: r
        for r in health_queries.list_nodes(
            session, request.app.state.settings.health, hostlist=name, limit=1
        ).items
    }
    ops = [
        o
        for o in session.execute(sa_select(Operation).order_by(col(Operation.id).desc()).limit(200)).scalars()
        if name in (o.results or {}) or _targets(o.targets, name)
    ][:20]
    context = {
        "node": view,
        "health": nh.get(name),
        "facts": hardware["facts"],
        "inventory_gpus": hardware["gpus"],
        "gpus": gpus,
        "charts": gpu_charts,
        "samples": samples,
        "events": events.query(session, target=name, limit=30),
        "health_events": health_queries.events(session, node=name, limit=30),
        "operations": ops,
        "actions": ACTIONS,
        "history_kept": keep,
    }
    return render(request, "ui/node.html", context, etag=True)


def _targets(hostlist: str, name: str) -> bool:
    if name not in hostlist and "[" not in hostlist:
        return False
    try:
        return name in expand_hostlist(hostlist)
    except BcmError:
        return False


# ---- operations ---------------------------------------------------------------------------------------


@router.get("/operations")
def operations_page(
    request: Request,
    me: Me,
    session: SessionDep,
    kind: Text = None,
    state: Text = None,
    offset: Annotated[int, Query(ge=0, le=2_147_483_647)] = 0,
) -> Response:
    kind_f, state_f = clean(kind, "kind", 32), clean(state, "state", 16)
    ops = op_svc.query(session, kind=kind_f, state=state_f, limit=51, offset=offset)
    params = {k: v for k, v in (("kind", kind_f), ("state", state_f)) if v}
    context = {
        "operations": ops[:50],
        "kind": kind_f or "",
        "state": state_f or "",
        "prev": "/ui/operations?" + urlencode({**params, "offset": max(0, offset - 50)}) if offset else None,
        "next": "/ui/operations?" + urlencode({**params, "offset": offset + 50}) if len(ops) > 50 else None,
    }
    return render(request, "ui/operations.html", context, etag=True)


@router.get("/operations/{op_id}")
def operation_page(
    request: Request, op_id: Annotated[int, Path_(ge=1, le=2_147_483_647)], me: Me, session: SessionDep
) -> Response:
    op = op_svc.get(session, op_id)
    results = sorted((op.results or {}).items())
    return render(
        request,
        "ui/operation.html",
        {"op": op, "results": results, "finished": op_svc.is_finished(op)},
        etag=True,
    )


# ---- health, images, workload managers, tenancy, PXE ----------------------------------------------------


@router.get("/health")
def health_page(request: Request, me: Me, session: SessionDep) -> Response:
    settings = request.app.state.settings.health
    bad = (
        sa_select(Node.name, GpuHealth)  # type: ignore[call-overload]
        .join(Node, col(Node.id) == col(GpuHealth.node_id))
        .where(col(GpuHealth.verdict).in_([Verdict.FAIL.value, Verdict.WARN.value]))
        .order_by(col(GpuHealth.verdict), col(Node.name), col(GpuHealth.index))
        .limit(200)
    )
    context = {
        "summary": health_queries.summary(session, settings),
        "failing_nodes": health_queries.list_nodes(session, settings, verdict="FAIL", limit=100),
        "bad_gpus": list(session.execute(bad).all()),
        "events": health_queries.events(session, limit=100),
    }
    return render(request, "ui/health.html", context, etag=True)


@router.get("/images")
def images_page(request: Request, me: Me, session: SessionDep) -> Response:
    return render(request, "ui/images.html", {"images": images.listing(session)}, etag=True)


@router.get("/wlm")
def wlm_page(request: Request, me: Me, session: SessionDep) -> Response:
    sizes = queries.cluster_sizes(session)
    rows: list[tuple[WlmCluster, int, str]] = []
    for c in wlm.query(session):
        controller = session.get(Node, c.controller_id)
        rows.append((c, sizes.get(c.id or 0, 0), controller.name if controller else "?"))
    return render(request, "ui/wlm.html", {"clusters": rows}, etag=True)


@router.get("/tenancy")
def tenancy_page(request: Request, me: Me, session: SessionDep) -> Response:
    departments = [tenancy.department_public(session, d) for d in tenancy.list_departments(session, me.token)]
    projects = [tenancy.project_public(session, p) for p in tenancy.list_projects(session, me.token)]
    held = wlm_usage.account_gpus(session)  # the sync's sample: no workload manager is asked here
    used = {p.name: held.get(p.name, 0) for p in projects}
    # a department's jobs run in its projects' accounts (and, rarely, its own)
    used.update({d.name: held.get(d.name, 0) + sum(held.get(p, 0) for p in d.projects) for d in departments})
    context = {
        "departments": departments,
        "projects": projects,
        "used": used,
        "sampled": wlm_usage.sampled(session),
    }
    return render(request, "ui/tenancy.html", context, etag=True)


@router.get("/pxe")
def pxe_page(request: Request, me: Me, session: SessionDep) -> Response:
    machines = discovered_api.list_discovered(session, me.token)
    context = {
        "machines": machines,
        "categories": queries.categories(session),
        "images": sorted({i.name for i in images.listing(session) if i.state == "ready"}),
    }
    return render(request, "ui/pxe.html", context, etag=True)
