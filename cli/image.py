"""`bcm image …`: build images from recipes, list and show versions, roll back, remove."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from cli.common import JsonOpt, client, follow
from cli.render import emit_json, out, safe, table

app = typer.Typer(
    help="Node images: recipes (images/*.yaml) built into versioned boot artifacts.", no_args_is_help=True
)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@app.command("recipes")
def recipes(as_json: JsonOpt = False) -> None:
    """The recipes the server can build, with their layer chains."""
    rows = client().get("/api/v1/images/recipes")
    if as_json:
        emit_json(rows)
        return
    table(
        None,
        ["RECIPE", "CHAIN", "PACKAGES", "DESCRIPTION"],
        [(r["name"], " → ".join(r["chain"]), r["packages"], r["description"]) for r in rows],
    )


@app.command("build")
def build(
    recipe: Annotated[str, typer.Argument(help="recipe name (images/<recipe>.yaml)")],
    version: Annotated[str | None, typer.Option(help="version to build (default: the next number)")] = None,
    wait: Annotated[bool, typer.Option(help="follow the build to its end")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Build a recipe (cached layers are reused); published and made current once verified."""
    c = client()
    started = c.post("/api/v1/images/build", {"recipe": recipe, "version": version})
    if not as_json:
        out.print(
            f"building {started['name']} version {started['version']} (operation {started['operation_id']}; "
            f"`bcm op show {started['operation_id']} --follow` streams its log)"
        )
    follow(c, started["operation_id"], wait=wait, as_json=as_json, show=_show_build)


def _show_build(op: dict[str, Any], as_json: bool) -> None:
    if as_json:
        emit_json(op)
        return
    if op.get("error"):
        out.print(op["error"].strip().splitlines()[-1], style="red")
    else:
        out.print(f"operation {op['id']} {op['kind']}: {op['state']}")


@app.command("list")
def list_images(as_json: JsonOpt = False) -> None:
    """Every version of every image; `*` marks the current one."""
    rows = client().get("/api/v1/images")
    if as_json:
        emit_json(rows)
        return
    table(
        None,
        ["IMAGE", "VERSION", "STATE", "CURRENT", "KERNEL", "DRIVER", "CUDA", "PUBLISHED"],
        [
            (
                i["name"],
                i["version"],
                i["state"],
                "*" if i["current"] else "",
                i["kernel_version"] or "",
                i["driver_version"] or "",
                i["cuda_version"] or "",
                i["published_at"] or "",
            )
            for i in rows
        ],
    )


@app.command("show")
def show(
    name: str,
    version: Annotated[str | None, typer.Option(help="a version (default: the current one)")] = None,
    as_json: JsonOpt = False,
) -> None:
    """One version: state, kernel/driver/CUDA, and its artifacts with size and sha256."""
    img = client().get(f"/api/v1/images/{name}", version=version)
    if as_json:
        emit_json(img)
        return
    out.print(
        safe(img["name"], style="bold"),
        f"version {img['version']}: {img['state']}"
        f"{' (current)' if img['current'] else ''}; layers {' → '.join(img['layers']) or '-'}; "
        f"kernel {img['kernel_version'] or '-'}, driver {img['driver_version'] or '-'}, "
        f"CUDA {img['cuda_version'] or '-'}, {img['packages']} packages",
    )
    if img.get("error"):
        out.print(img["error"].strip().splitlines()[-1], style="red")
    table(
        None,
        ["ARTIFACT", "FILE", "SIZE", "SHA256", "URL"],
        [(a["kind"], a["filename"], _size(a["size"]), a["sha256"], a["url"]) for a in img["artifacts"]],
    )


@app.command("rollback")
def rollback(name: str, as_json: JsonOpt = False) -> None:
    """Make the ready version before the current one current again."""
    img = client().post(f"/api/v1/images/{name}/rollback", {})
    emit_json(img) if as_json else out.print(f"{img['name']}: version {img['version']} is current")


@app.command("rm")
def remove(
    name: str,
    version: Annotated[str | None, typer.Option(help="remove only this version")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove an image (or one version); refused while a node or category uses it."""
    res = client().delete(f"/api/v1/images/{name}", **({"version": version} if version else {}))
    emit_json(res) if as_json else out.print(f"removed {name} version(s) {', '.join(res['removed'])}")


@app.command("push")
def push(
    image: Annotated[str, typer.Argument(help="image name")],
    nodes: Annotated[str, typer.Argument(help="hostlist, e.g. gpu[01-16]")],
    version: Annotated[str | None, typer.Option(help="version to push (default: the current one)")] = None,
    apply: Annotated[bool, typer.Option("--apply", help="write to the nodes (default: a dry run)")] = False,
    wait: Annotated[bool, typer.Option(help="follow the push to its end")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Sync an image version onto running nodes (rsync); a dry run that changes nothing unless --apply."""
    c = client()
    started = c.post(f"/api/v1/images/{image}/push", {"nodes": nodes, "version": version, "apply": apply})
    if not as_json:
        mode = "writing to" if apply else "dry run (nothing changes; --apply to write) on"
        out.print(
            f"pushing {started['name']} version {started['version']}: {mode} {started['nodes']} node(s) "
            f"(operation {started['operation_id']})"
        )
    follow(c, started["operation_id"], wait=wait, as_json=as_json, show=_show_push)


def _show_push(op: dict[str, Any], as_json: bool) -> None:
    if as_json:
        emit_json(op)
        return
    rows = []
    for name, r in sorted((op.get("results") or {}).items()):
        if r.get("status") == "ok":
            sample = (r.get("sample") or [""])[0]
            detail = f"{'would change' if r.get('dry_run') else 'changed'} {r.get('changed', 0)}"
            if r.get("bytes") is not None:
                detail += f", {_size(r['bytes'])}"
            detail += f"; e.g. {sample}" if sample else ""
        else:
            detail = r.get("message") or r.get("error") or ""
        rows.append((name, r.get("status"), r.get("changed", ""), detail))
    table(f"operation {op['id']} {op['kind']}: {op['state']}", ["NODE", "RESULT", "CHANGED", "DETAIL"], rows)
    if op.get("error"):
        out.print(op["error"], style="red")
