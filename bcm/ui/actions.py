"""The dashboard's forms that change things: bulk node actions (a confirmation page naming the nodes
first), and assigning a discovered machine. Each is CSRF-checked and role-checked here, with the API's
role rules, and done by the services and workers the API calls (which record the events)."""

from __future__ import annotations

from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from bcm.api.deps import SessionDep
from bcm.api.limits import CONTROL_CHARS
from bcm.domain.naming import expand_hostlist, fold_hostlist
from bcm.domain.power import PowerAction
from bcm.errors import InvalidInput
from bcm.models.pxe import AssignRequest
from bcm.services import pxe
from bcm.ui import queries
from bcm.ui.routes import ACTIONS, POWER_ACTIONS, clean
from bcm.ui.web import Me, UiRoute, check_csrf, read_form, redirect, render, require_operator
from bcm.workers import power as power_worker

router = APIRouter(prefix="/ui", route_class=UiRoute, include_in_schema=False)
SHOWN = 500  # names listed one by one on the confirmation page (all of them are in its hostlist)


def _reason(form: dict[str, str]) -> str | None:
    reason = (form.get("reason") or "").strip()
    if len(reason) > 512 or CONTROL_CHARS.search(reason):
        raise InvalidInput("reason: at most 512 printable characters", field="reason")
    return reason or None


def _action(form: dict[str, str]) -> str:
    action = form.get("action", "")
    if action not in ACTIONS:
        raise InvalidInput(f"action: one of {', '.join(ACTIONS)}", field="action")
    return action


@router.post("/nodes/confirm")
async def confirm(request: Request, me: Me, session: SessionDep) -> Response:
    """The nodes an action would touch, by name, and one button to do it."""
    form = await read_form(request)
    check_csrf(request, me, form)
    require_operator(me)
    action, reason = _action(form), _reason(form)
    if form.get("scope") == "matching":
        f = queries.NodeFilter(
            nodes=clean(form.get("f_nodes"), "nodes", 8192),
            state=clean(form.get("f_state"), "state", 16),
            category=clean(form.get("f_category"), "category"),
            health=clean(form.get("f_health"), "health", 16),
        )
        names = queries.matching_names(session, f)
    else:
        names = []
        for part in (form.get("selected") or "", form.get("nodes") or ""):
            if part.strip():
                names += expand_hostlist(part.strip(), "nodes")
        names = list(dict.fromkeys(names))
    if not names:
        raise InvalidInput("nodes: select at least one node (or name them by hostlist)", field="nodes")
    from bcm.services import nodes as node_svc

    node_svc.get_many(session, names)  # 404 naming every unknown node, before anything is asked
    context = {
        "action": action,
        "reason": reason,
        "names": names[:SHOWN],
        "count": len(names),
        "hostlist": fold_hostlist(names),
    }
    return render(request, "ui/confirm.html", context)


@router.post("/nodes/act")
async def act(request: Request, me: Me) -> Response:
    """Do a confirmed action; an operation's page follows it, plain verbs come back to the Nodes table."""
    form = await read_form(request)
    check_csrf(request, me, form)
    require_operator(me)
    action, reason = _action(form), _reason(form)
    names = expand_hostlist((form.get("nodes") or "").strip(), "nodes")
    runner = request.app.state.runner
    if action in POWER_ACTIONS:
        op_id = await power_worker.start(
            runner, PowerAction(action.removeprefix("power-")), names, me.actor, reason
        )
        return redirect(f"/ui/operations/{op_id}")
    result = await runner.verb(action, names, me.actor, reason)
    if result.operation_id is not None:
        return redirect(f"/ui/operations/{result.operation_id}")
    hostlist = fold_hostlist(names)
    params = {"nodes": hostlist} if len(hostlist) <= 4000 else {}
    return redirect("/ui/nodes?" + urlencode({**params, "done": action}))


@router.post("/pxe/assign")
async def assign(request: Request, me: Me, session: SessionDep) -> Response:
    form = await read_form(request)
    check_csrf(request, me, form)
    require_operator(me)
    try:
        req = AssignRequest(
            mac=form.get("mac", ""),
            name=(form.get("name") or "").strip(),
            category=clean(form.get("category"), "category"),
            image=clean(form.get("image"), "image", 128),
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ())) or "form"
        raise InvalidInput(
            f"{field}: {str(first['msg']).removeprefix('Value error, ')}", field=field
        ) from None
    node = pxe.assign(session, req, me.actor)
    return redirect(f"/ui/nodes/{node.name}")
