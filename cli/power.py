"""`bcm power …`: switch nodes on, off, cycle them or boot them from the network, through their BMCs."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from cli.client import CliError
from cli.common import JsonOpt, client, follow
from cli.render import out

app = typer.Typer(help="Power control through the nodes' BMCs (IPMI or Redfish).", no_args_is_help=True)
Nodes = Annotated[str, typer.Argument(help="node name or hostlist, e.g. gpu[01-16]")]


def _read_password() -> str:
    password = sys.stdin.readline().rstrip("\n")
    if not password:
        raise CliError("no password on stdin")
    return password


@app.command("set")
def set_bmc(
    nodes: Nodes,
    address: Annotated[
        str | None, typer.Option(help="BMC address: host[:port], or http(s)://host[:port]")
    ] = None,
    protocol: Annotated[str | None, typer.Option(help="ipmi or redfish")] = None,
    user: Annotated[str | None, typer.Option(help="BMC user")] = None,
    password_stdin: Annotated[
        bool, typer.Option("--password-stdin", help="read the BMC password from stdin")
    ] = False,
) -> None:
    """Set nodes' BMC settings; the password is read from stdin, stored encrypted, never shown, and sent
    only to the BMC the node has now (after an address or protocol change, set it again)."""
    body = {
        k: v for k, v in {"bmc_address": address, "bmc_protocol": protocol, "bmc_user": user}.items() if v
    }
    c = client()
    names = [n["name"] for n in c.get("/api/v1/nodes", nodes=nodes, limit=1000)["items"]]
    if not names:
        raise CliError(f"no nodes match {nodes}")
    if body:
        for name in names:
            c.patch(f"/api/v1/nodes/{name}", body)
    if password_stdin:
        c.request("PUT", "/api/v1/nodes/bmc-password", json={"nodes": nodes, "password": _read_password()})
    out.print(f"updated {len(names)} node(s)")
    if (address or protocol) and not password_stdin:
        out.print(
            "a BMC password is sent only to the BMC it was set for: set it again (--password-stdin, admin)"
        )


@app.command("set-category")
def set_category(
    name: str,
    protocol: Annotated[str | None, typer.Option(help="ipmi or redfish")] = None,
    user: Annotated[str | None, typer.Option(help="BMC user")] = None,
    password_stdin: Annotated[
        bool,
        typer.Option(
            "--password-stdin",
            help="read the BMC password from stdin; it is used for the BMCs the category's nodes have now",
        ),
    ] = False,
    discover_range: Annotated[
        str | None,
        typer.Option(
            help="with --password-stdin: BMCs that discoveries report inside this network (the category's "
            "discovery rule registered them) get the password too (zero-touch)",
        ),
    ] = None,
    allow_http: Annotated[
        bool | None,
        typer.Option(
            "--allow-http/--no-allow-http",
            help="allow the category's Redfish BMCs on plain http (passwords cross the network in clear)",
        ),
    ] = None,
) -> None:
    """Set the BMC protocol, user and password that a category's nodes inherit."""
    c = client()
    body = {k: v for k, v in {"bmc_protocol": protocol, "bmc_user": user}.items() if v}
    if body:
        c.patch(f"/api/v1/categories/{name}", body)
    if allow_http is not None:
        c.request("PUT", f"/api/v1/categories/{name}/bmc-allow-http", json={"allow": allow_http})
    if discover_range and not password_stdin:
        raise CliError("--discover-range is set with the password: add --password-stdin")
    if password_stdin:
        pw: dict[str, str] = {"password": _read_password()}
        if discover_range:
            pw["discover_range"] = discover_range
        c.request("PUT", f"/api/v1/categories/{name}/bmc-password", json=pw)
    out.print(f"updated category {name}")


@app.command("unpin")
def unpin(nodes: Nodes) -> None:
    """Forget the pinned TLS certificates of nodes' Redfish BMCs (after a certificate was replaced)."""
    res = client().post("/api/v1/nodes/bmc-unpin", {"nodes": nodes})
    out.print(f"cleared {res['updated']} pin(s); the next contact pins the certificate the BMC presents")


def _action(action: str, help_text: str) -> None:
    def command(
        nodes: Nodes,
        reason: Annotated[str | None, typer.Option(help="recorded with the action")] = None,
        wait: Annotated[bool, typer.Option(help="follow the operation to its end")] = True,
        as_json: JsonOpt = False,
    ) -> None:
        c = client()
        res: dict[str, Any] = c.post(
            f"/api/v1/nodes/actions/power-{action}", {"nodes": nodes, "reason": reason}
        )
        follow(c, res["operation_id"], wait=wait, as_json=as_json)

    command.__doc__ = help_text
    app.command(action)(command)


for _a, _h in [
    ("status", "Read the power state from each node's BMC."),
    ("on", "Power nodes on."),
    ("off", "Power nodes off at once (no shutdown)."),
    ("soft-off", "Ask nodes' operating systems to shut down (ACPI)."),
    ("cycle", "Power nodes off and on again (on, if they were off)."),
    ("pxe", "Boot nodes from the network once: next boot PXE, then power on or cycle."),
]:
    _action(_a, _h)


def register_lab_vms(c: Any, lab_state_dir: Any, category: str | None) -> None:
    """Register `bcm lab up --vms` machines with their BMC settings (replacing earlier labs' records)."""
    from bcm.lab import vm

    vms = vm.load(lab_state_dir)
    names = ",".join(v.name for v in vms)
    if names and c.get("/api/v1/nodes", nodes=names, limit=1000)["items"]:
        c.delete("/api/v1/nodes", nodes=names)
    for v in vms:
        c.post(
            "/api/v1/nodes",
            {
                "name": v.name,
                "mac": v.mac,
                "category": category,
                "bmc_address": v.bmc.address,
                "bmc_protocol": v.bmc.kind,
                "bmc_user": v.bmc.user,
            },
        )
        c.request("PUT", "/api/v1/nodes/bmc-password", json={"nodes": v.name, "password": v.bmc.password})
    out.print(
        f"registered {len(vms)} VM(s) with their BMCs: "
        + ", ".join(f"{v.name} {v.bmc.kind} {v.bmc.address}" for v in vms)
    )
