"""`bcm category …`: the defaults nodes inherit."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from cli.common import JsonOpt, client
from cli.render import emit_json, err, kv, out, table

app = typer.Typer(
    help="Categories: defaults (image, kernel args, WLM role) that nodes inherit.", no_args_is_help=True
)


def _body(**fields: str | bool | None) -> dict[str, str | bool]:
    return {k: v for k, v in fields.items() if v is not None}


AutoProvision = Annotated[
    bool | None,
    typer.Option(
        "--auto-provision/--no-auto-provision",
        help="zero-touch: provision what the discovery rule registers at once (its BMC reported and usable)",
    ),
]
WlmCluster = Annotated[
    str | None, typer.Option(help="zero-touch: the workload-manager cluster its booted nodes join, verified")
]


@app.command("add")
def add(
    name: str,
    image: Annotated[str | None, typer.Option()] = None,
    kernel_args: Annotated[str | None, typer.Option()] = None,
    wlm_role: Annotated[str | None, typer.Option()] = None,
    description: Annotated[str | None, typer.Option()] = None,
    discover_mac_prefix: Annotated[
        str | None, typer.Option(help="PXE: machines whose MAC starts so join this category at discovery")
    ] = None,
    discover_names: Annotated[
        str | None, typer.Option(help="…named from this hostlist, first free first")
    ] = None,
    auto_provision: AutoProvision = None,
    wlm_cluster: WlmCluster = None,
) -> None:
    """Create a category."""
    client().post(
        "/api/v1/categories",
        _body(
            name=name,
            image=image,
            kernel_args=kernel_args,
            wlm_role=wlm_role,
            description=description,
            discover_mac_prefix=discover_mac_prefix,
            discover_names=discover_names,
            auto_provision=auto_provision,
            wlm_cluster=wlm_cluster,
        ),
    )
    out.print(f"created category {name}")


@app.command("list")
def list_categories(as_json: JsonOpt = False) -> None:
    """List categories."""
    cats = client().get("/api/v1/categories")
    if as_json:
        emit_json(cats)
        return
    table(
        None,
        ["NAME", "NODES", "IMAGE", "WLM ROLE", "KERNEL ARGS", "DESCRIPTION"],
        [
            (c["name"], c["node_count"], c["image"], c["wlm_role"], c["kernel_args"], c["description"])
            for c in cats
        ],
    )


@app.command("show")
def show(name: str, as_json: JsonOpt = False) -> None:
    """One category."""
    cat = client().get(f"/api/v1/categories/{name}")
    if as_json:
        emit_json(cat)
    else:
        kv(cat["name"], [(k, v) for k, v in cat.items() if k != "name"])


@app.command("set")
def set_category(
    name: str,
    image: Annotated[str | None, typer.Option()] = None,
    kernel_args: Annotated[str | None, typer.Option()] = None,
    wlm_role: Annotated[str | None, typer.Option()] = None,
    description: Annotated[str | None, typer.Option()] = None,
    discover_mac_prefix: Annotated[str | None, typer.Option(help="PXE discovery rule: MAC prefix")] = None,
    discover_names: Annotated[str | None, typer.Option(help="PXE discovery rule: names (hostlist)")] = None,
    auto_provision: AutoProvision = None,
    wlm_cluster: WlmCluster = None,
) -> None:
    """Change a category."""
    client().patch(
        f"/api/v1/categories/{name}",
        _body(
            image=image,
            kernel_args=kernel_args,
            wlm_role=wlm_role,
            description=description,
            discover_mac_prefix=discover_mac_prefix,
            discover_names=discover_names,
            auto_provision=auto_provision,
            wlm_cluster=wlm_cluster,
        ),
    )
    out.print(f"updated category {name}")


Mode = Annotated[str | None, typer.Option("--mode", help="stateless, full, auto or nosync (#30)")]


@app.command("install")
def install(
    name: str,
    mode: Mode = None,
    layout: Annotated[
        Path | None, typer.Option(help="the disk layout: a YAML or JSON file (see README, Install to disk)")
    ] = None,
    clear_layout: Annotated[
        bool, typer.Option("--clear-layout", help="remove the category's disk layout")
    ] = False,
    confirm_wipe: Annotated[
        bool, typer.Option(help="admin: data nodes among the members may be wiped (once)")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Set (or show) the members' install mode and disk layout, checked against their inventoried disks."""
    body: dict[str, Any] = {}
    if mode is not None:
        body["install_mode"] = mode
    if layout is not None:
        try:
            body["disk_layout"] = yaml.safe_load(layout.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            err.print(f"error: --layout {layout.name}: {why}", soft_wrap=True)
            raise typer.Exit(2) from None
    elif clear_layout:
        body["disk_layout"] = None
    if confirm_wipe:
        body["confirm_wipe"] = True
    c = client()
    cat = c.put(f"/api/v1/categories/{name}/install", body) if body else c.get(f"/api/v1/categories/{name}")
    if as_json:
        emit_json({"install_mode": cat["install_mode"], "disk_layout": cat["disk_layout"]})
        return
    kv(
        name,
        [
            ("install mode", cat["install_mode"] or "stateless (default)"),
            (
                "disk layout",
                yaml.safe_dump(cat["disk_layout"], sort_keys=False).strip() if cat["disk_layout"] else None,
            ),
        ],
    )


@app.command("rm")
def remove(name: str) -> None:
    """Remove an unused category."""
    client().delete(f"/api/v1/categories/{name}")
    out.print(f"removed category {name}")
