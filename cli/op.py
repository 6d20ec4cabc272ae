"""`bcm op …`: long operations and their progress."""

from __future__ import annotations

import sys
import time
from typing import Annotated, Any

import typer

from cli.client import CliError
from cli.common import JsonOpt, client, show_operation, wait_operation
from cli.render import emit_json, plain, table

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
def show(
    op_id: int,
    as_json: JsonOpt = False,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="stream the log until the operation ends")
    ] = False,
    timeout: Annotated[float, typer.Option(help="with --follow: give up after this many seconds")] = 7200,
) -> None:
    """One operation with per-node results; ``--follow`` streams its log as it grows."""
    c = client()
    op = c.get(f"/api/v1/operations/{op_id}")
    if follow and not as_json:
        op = _stream_log(c, op_id, op, timeout)
    show_operation(op, as_json)


def _stream_log(c: Any, op_id: int, op: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Print the log of an operation as it grows until the operation ends (bounded by ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    shown = 0
    while True:
        log = op.get("log") or ""
        if len(log) < shown:  # the log was cut in the middle: go on from its new end
            shown = 0
        sys.stdout.write(plain(log[shown:], lines=True))  # a log holds what nodes printed: escapes shown
        sys.stdout.flush()
        shown = len(log)
        if op["state"] not in ("pending", "running"):
            return op
        if time.monotonic() > deadline:
            raise CliError(f"operation {op_id} still {op['state']} after {timeout_s:.0f}s")
        time.sleep(0.5)
        op = c.get(f"/api/v1/operations/{op_id}")


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
