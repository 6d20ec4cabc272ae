"""`bcm op …`: long operations and their progress."""

from __future__ import annotations

from typing import Annotated

import typer

from cli.common import JsonOpt, client, show_operation, wait_operation
from cli.render import emit_json, table

app = typer.Typer(
    help="Operations: long jobs (inventory, deploys) with progress and per-node results.",
    no_args_is_help=True,
)


@app.command("list")
def list_ops(
    kind: Annotated[str | None, typer.Option()] = None,
    state: Annotated[str | None, typer.Option()] = None,
    limit: Annotated[int, typer.Option()] = 50,
    as_json: JsonOpt = False,
) -> None:
    """Recent operations, newest first."""
    ops = client().get("/api/v1/operations", kind=kind, state=state, limit=limit)
    if as_json:
        emit_json(ops)
        return
    table(
        None,
        ["ID", "KIND", "STATE", "PROGRESS", "TARGETS", "BY", "CREATED"],
        [
            (
                o["id"],
                o["kind"],
                o["state"],
                f"{o['progress_done']}/{o['progress_total']}",
                o["targets"][:40],
                o["created_by"],
                o["created_at"],
            )
            for o in ops
        ],
    )


@app.command("show")
def show(op_id: int, as_json: JsonOpt = False) -> None:
    """One operation with per-node results."""
    show_operation(client().get(f"/api/v1/operations/{op_id}"), as_json)


@app.command("wait")
def wait(
    op_id: int,
    timeout: Annotated[float, typer.Option(help="give up after this many seconds")] = 3600,
    as_json: JsonOpt = False,
) -> None:
    """Follow an operation with a progress bar until it ends; exit 1 unless it succeeded."""
    op = wait_operation(client(), op_id, timeout_s=timeout, quiet=as_json)
    if as_json:
        emit_json(op)
    else:
        show_operation(op, False)
    if op["state"] != "succeeded":
        raise typer.Exit(1)


@app.command("cancel")
def cancel(op_id: int, as_json: JsonOpt = False) -> None:
    """Stop a running operation; its node locks are released and finished hosts keep their results."""
    show_operation(client().post(f"/api/v1/operations/{op_id}/cancel"), as_json)
