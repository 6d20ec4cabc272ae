"""`bcm dept …`, `bcm project …`, `bcm tenancy …`: departments, projects and their members, and their
rendering into the workload manager (a plan to read first, then apply)."""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import quote

import typer

from cli.common import JsonOpt, client, follow, print_failure
from cli.render import emit_json, kv, out, table

dept_app = typer.Typer(
    help="Departments: a GPU quota shared by their projects, a fair-share weight.", no_args_is_help=True
)
project_app = typer.Typer(
    help="Projects: deserved GPUs, an over-quota limit, a fair-share weight, members.", no_args_is_help=True
)
tenancy_app = typer.Typer(
    help="Render departments and projects into the workload manager.", no_args_is_help=True
)
members_app = typer.Typer(help="A project's members (bcm users).", no_args_is_help=True)
project_app.add_typer(members_app, name="members")

Fairshare = Annotated[int | None, typer.Option(help="fair-share weight (relative to its siblings)")]
Cluster = Annotated[str | None, typer.Option(help="workload-manager cluster (default: the only one)")]


def _drop_none(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if v is not None}


# ---- departments -----------------------------------------------------------------------------------------


@dept_app.command("add")
def dept_add(
    name: str,
    gpus: Annotated[int, typer.Option("--gpus", help="GPU quota its projects share")],
    fairshare: Fairshare = None,
    description: Annotated[str | None, typer.Option()] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a department."""
    body = _drop_none({"name": name, "gpu_quota": gpus, "fairshare": fairshare, "description": description})
    row = client().post("/api/v1/departments", body)
    if as_json:
        emit_json(row)
        return
    out.print(f"created department {name} ({gpus} GPUs); run `bcm tenancy plan` to see what Slurm is told")


@dept_app.command("list")
def dept_list(as_json: JsonOpt = False) -> None:
    """List departments (those you may see)."""
    rows = client().get("/api/v1/departments")
    if as_json:
        emit_json(rows)
        return
    table(
        None,
        ["NAME", "GPU QUOTA", "DESERVED", "FAIRSHARE", "PROJECTS", "ADMINS"],
        [
            (
                d["name"],
                d["gpu_quota"],
                d["deserved_gpus"],
                d["fairshare"],
                ",".join(d["projects"]),
                ",".join(d["admins"]),
            )
            for d in rows
        ],
    )


@dept_app.command("set")
def dept_set(
    name: str,
    gpus: Annotated[int | None, typer.Option("--gpus", help="GPU quota")] = None,
    fairshare: Fairshare = None,
    description: Annotated[str | None, typer.Option()] = None,
    add_admin: Annotated[
        list[str] | None, typer.Option("--add-admin", help="bind a user as its admin")
    ] = None,
    rm_admin: Annotated[list[str] | None, typer.Option("--rm-admin", help="unbind an admin")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Change a department's quota or weight, or its admins."""
    c = client()
    body = _drop_none({"gpu_quota": gpus, "fairshare": fairshare, "description": description})
    row = c.patch(f"/api/v1/departments/{name}", body) if body else c.get(f"/api/v1/departments/{name}")
    for user in add_admin or []:
        row = c.post(f"/api/v1/departments/{name}/admins", {"user": user})
    for user in rm_admin or []:
        row = c.delete(f"/api/v1/departments/{name}/admins/{user}")
    if as_json:
        emit_json(row)
        return
    kv(f"department {name}", [(k, row[k]) for k in ("gpu_quota", "deserved_gpus", "fairshare", "admins")])


@dept_app.command("rm")
def dept_rm(name: str) -> None:
    """Remove a department (it must have no projects)."""
    client().delete(f"/api/v1/departments/{name}")
    out.print(f"removed department {name}; `bcm tenancy apply` removes its Slurm account")


# ---- projects --------------------------------------------------------------------------------------------


def _project_row(p: dict[str, Any]) -> tuple[Any, ...]:
    return (
        p["name"],
        p["department"],
        p["deserved_gpus"],
        p["limit_gpus"],
        p["fairshare"],
        ",".join(p["members"]),
    )


PROJECT_COLUMNS = ["NAME", "DEPARTMENT", "DESERVED", "LIMIT", "FAIRSHARE", "MEMBERS"]


@project_app.command("add")
def project_add(
    name: str,
    department: Annotated[str, typer.Option("--dept", help="department it draws its GPUs from")],
    gpus: Annotated[int, typer.Option("--gpus", help="deserved (guaranteed) GPUs")],
    limit: Annotated[int | None, typer.Option("--limit", help="most GPUs at once (default: --gpus)")] = None,
    fairshare: Fairshare = None,
    description: Annotated[str | None, typer.Option()] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a project in a department."""
    body = _drop_none(
        {
            "name": name,
            "department": department,
            "deserved_gpus": gpus,
            "limit_gpus": limit,
            "fairshare": fairshare,
            "description": description,
        }
    )
    row = client().post("/api/v1/projects", body)
    if as_json:
        emit_json(row)
        return
    out.print(
        f"created project {name} in {department} ({row['deserved_gpus']} deserved, limit {row['limit_gpus']})"
    )


@project_app.command("list")
def project_list(
    department: Annotated[str | None, typer.Option("--dept", help="only this department's")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List projects (those you may see)."""
    rows = client().get("/api/v1/projects", department=department)
    if as_json:
        emit_json(rows)
        return
    table(None, PROJECT_COLUMNS, [_project_row(p) for p in rows])


@project_app.command("set")
def project_set(
    name: str,
    department: Annotated[str | None, typer.Option("--dept", help="move it to this department")] = None,
    gpus: Annotated[int | None, typer.Option("--gpus", help="deserved GPUs")] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="over-quota limit")] = None,
    fairshare: Fairshare = None,
    description: Annotated[str | None, typer.Option()] = None,
    as_json: JsonOpt = False,
) -> None:
    """Change a project's quota, limit, weight or department."""
    body = _drop_none(
        {
            "department": department,
            "deserved_gpus": gpus,
            "limit_gpus": limit,
            "fairshare": fairshare,
            "description": description,
        }
    )
    row = client().patch(f"/api/v1/projects/{name}", body)
    if as_json:
        emit_json(row)
        return
    table(None, PROJECT_COLUMNS, [_project_row(row)])


@project_app.command("rm")
def project_rm(name: str) -> None:
    """Remove a project; `bcm tenancy apply` removes its Slurm account and associations."""
    client().delete(f"/api/v1/projects/{name}")
    out.print(f"removed project {name}")


@project_app.command("usage")
def project_usage(name: str, as_json: JsonOpt = False) -> None:
    """A project's quotas and what the workload manager reports (fair share, GPUs running, pending)."""
    row = client().get(f"/api/v1/projects/{name}/usage")
    if as_json:
        emit_json(row)
        return
    pairs = [(k, row[k]) for k in ("department", "deserved_gpus", "limit_gpus", "fairshare")]
    wlm = row.get("wlm") or {}
    pairs += [(f"wlm {k}", v) for k, v in wlm.items() if k != "account"] or [("wlm", "no cluster to ask")]
    kv(f"project {name}", pairs)


@members_app.command("list")
def members_list(project: str, as_json: JsonOpt = False) -> None:
    """A project's members."""
    rows = client().get(f"/api/v1/projects/{project}/members")
    if as_json:
        emit_json(rows)
        return
    table(None, ["USER"], [(u,) for u in rows])


@members_app.command("add")
def members_add(project: str, users: list[str]) -> None:
    """Bind users as members (they become Slurm users of the project's account on apply)."""
    c = client()
    for user in users:
        c.post(f"/api/v1/projects/{project}/members", {"user": user})
    out.print(f"added {', '.join(users)} to {project}")


@members_app.command("rm")
def members_rm(project: str, users: list[str]) -> None:
    """Unbind members."""
    c = client()
    for user in users:
        c.delete(f"/api/v1/projects/{project}/members/{user}")
    out.print(f"removed {', '.join(users)} from {project}")


# ---- plan / apply ----------------------------------------------------------------------------------------


def _show_plan(plan: dict[str, Any], as_json: bool) -> None:
    if as_json:
        emit_json(plan)
        return
    changes = plan["changes"]
    verb = "applied" if plan["applied"] else "to apply"
    table(
        f"cluster {plan['cluster']}: {len(changes)} changes {verb}, {plan['drift']} drift",
        ["", "KIND", "NAME", "CHANGE", "DRIFT"],
        [(c["action"], c["kind"], c["name"], c["detail"], "drift" if c["drift"] else "") for c in changes],
    )
    for note in plan["notes"]:
        out.print(f"note: {note}", style="yellow")


@tenancy_app.command("plan")
def plan(cluster: Cluster = None, as_json: JsonOpt = False) -> None:
    """What the workload manager would be told (nothing changes); hand edits there show as drift."""
    _show_plan(client().get("/api/v1/tenancy/plan", cluster=cluster), as_json)


@tenancy_app.command("apply")
def apply(
    cluster: Cluster = None,
    as_json: JsonOpt = False,
    wait: Annotated[bool, typer.Option("--wait/--no-wait", help="follow the operation to its end")] = True,
) -> None:
    """Tell the workload manager (idempotent: applying again changes nothing); an operation, followed."""
    path = "/api/v1/tenancy/apply" + (f"?cluster={quote(cluster)}" if cluster else "")
    c = client()
    started = c.post(path)

    def show(op: dict[str, Any], as_json: bool) -> None:
        _show_plan(
            op.get("outcome")
            or {"cluster": started["cluster"], "applied": False, "changes": [], "drift": 0, "notes": []},
            as_json,
        )
        if op["state"] != "succeeded" and not as_json:
            print_failure(op)

    follow(c, int(started["operation_id"]), wait=wait, as_json=as_json, show=show)
