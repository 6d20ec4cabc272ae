"""`bcm lab up|down|status`: a lab of real SSH nodes on this machine (needs root), registered with the server."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.client import CliError
from cli.common import JsonOpt, client
from cli.render import emit_json, err, out, table

app = typer.Typer(
    help="A lab of SSH nodes in network namespaces, to try bcm without hardware (root).", no_args_is_help=True
)
StateDir = Annotated[Path, typer.Option(help="where the lab keeps its state")]
Name = Annotated[str, typer.Option(help="lab name (bridge namespace; node namespaces get it as prefix)")]
Subnet = Annotated[str, typer.Option(help="lab subnet, inside 198.18.0.0/15")]


def _lab(state_dir: Path, name: str = "bcmlab", subnet: str = "198.18.0.0/24"):  # type: ignore[no-untyped-def]
    from bcm.lab import Lab, LabError

    try:
        return Lab(state_dir, name, subnet=subnet)
    except LabError as exc:
        raise CliError(exc.message) from None


@app.command("up")
def up(
    nodes: Annotated[int, typer.Option("--nodes", "-n", help="how many SSH nodes")] = 4,
    category: Annotated[str | None, typer.Option(help="category for the registered nodes")] = None,
    register: Annotated[bool, typer.Option(help="register the nodes with the running server")] = True,
    state_dir: StateDir = Path("/var/lib/bcm-lab"),
    name: Name = "bcmlab",
    subnet: Subnet = "198.18.0.0/24",
    as_json: JsonOpt = False,
) -> None:
    """Bring up N SSH nodes (node01…) and register them (name, MAC, IP, host key) with the server."""
    from bcm.lab import LabError

    c = client() if register else None
    keys = [c.get("/api/v1/ssh/public-key")["public_key"]] if c else []
    try:
        lab_nodes = _lab(state_dir, name, subnet).up(nodes, keys)
    except LabError as exc:
        raise CliError(exc.message) from None
    if c:
        names = [n.name for n in lab_nodes]
        existing = (
            {n["name"] for n in c.get("/api/v1/nodes", nodes=",".join(names), limit=1000)["items"]}
            if names
            else set()
        )
        if existing:  # a previous lab's nodes: their host keys and state are stale
            c.delete("/api/v1/nodes", nodes=",".join(sorted(existing)))
        for n in lab_nodes:
            c.post(
                "/api/v1/nodes",
                {
                    "name": n.name,
                    "mac": n.mac,
                    "ip": n.ip,
                    "category": category,
                    "ssh_host_key": n.host_key_public,
                },
            )
        err.print(f"registered {len(lab_nodes)} node(s) with {c.url}")
    _show(lab_nodes, as_json)


@app.command("down")
def down(state_dir: StateDir = Path("/var/lib/bcm-lab"), name: Name = "bcmlab") -> None:
    """Remove every namespace, mount, process and bridge the lab made (nodes stay registered)."""
    _lab(state_dir, name).down()
    out.print("lab is down")


@app.command("status")
def status(
    state_dir: StateDir = Path("/var/lib/bcm-lab"), name: Name = "bcmlab", as_json: JsonOpt = False
) -> None:
    """Lab nodes and whether their sshd runs."""
    _show(_lab(state_dir, name).status(), as_json)


def _show(nodes: list, as_json: bool) -> None:  # type: ignore[type-arg]
    if as_json:
        emit_json([n.to_dict() for n in nodes])
    else:
        table(
            None,
            ["NAME", "IP", "MAC", "NETNS", "SSHD"],
            [(n.name, n.ip, n.mac, n.netns, "up" if n.alive else "down") for n in nodes],
        )
