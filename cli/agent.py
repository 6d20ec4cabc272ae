"""`bcm agent deploy NODES` and `bcm node token NODE`: the GPU health agent on nodes, and its tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from cli.client import CliError
from cli.common import JsonOpt, client, follow
from cli.render import emit_json, err, out

app = typer.Typer(help="The node agent: deploy it to nodes over SSH.", no_args_is_help=True)


@app.command("deploy")
def deploy(
    nodes: Annotated[str, typer.Argument(help="node name or hostlist, e.g. gpu[01-16]")],
    server_url: Annotated[
        str | None,
        typer.Option(help="URL the nodes reach bcm at (default: BCM_PXE__SERVER_URL on the server)"),
    ] = None,
    interval: Annotated[
        float | None, typer.Option(help="seconds between reports (default: the server's)")
    ] = None,
    fake_nvml: Annotated[
        Path | None,
        typer.Option(help="lab only: a recorded NVML fixture the agents answer from", exists=True),
    ] = None,
    wait: Annotated[bool, typer.Option(help="follow the operation to its end")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Install the agent (needs only python3 on the node), write its config 0600 and start it."""
    body: dict[str, Any] = {"nodes": nodes, "server_url": server_url, "interval_s": interval}
    if fake_nvml is not None:
        try:
            body["nvml_fixture"] = json.loads(fake_nvml.read_text())
        except ValueError as exc:
            raise CliError(f"{fake_nvml} is not JSON: {exc}") from None
    c = client()
    started = c.post("/api/v1/agents/deploy", {k: v for k, v in body.items() if v is not None})
    follow(c, started["operation_id"], wait=wait, as_json=as_json)


def node_token(
    name: Annotated[str, typer.Argument(help="node name")],
    as_json: JsonOpt = False,
) -> None:
    """Issue a fresh agent token for a node (printed once; the old one stops working)."""
    tok = client().post(f"/api/v1/nodes/{name}/token")
    if as_json:
        emit_json(tok)
        return
    err.print(f"agent token for {tok['node']}; store it now, it is not shown again (the old one is revoked):")
    out.print(tok["token"])
