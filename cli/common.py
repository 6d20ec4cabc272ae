"""Options shared by every command."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cli.client import Client, CliError
from cli.render import err

JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]
UrlOpt = Annotated[str | None, typer.Option("--url", envvar="BCM_URL", help="server URL", show_default=False)]
TokenOpt = Annotated[
    str | None,
    typer.Option("--token", envvar="BCM_TOKEN", help="API token", show_default=False, show_envvar=False),
]

_state: dict[str, Any] = {"url": None, "token": None}


def configure(url: str | None, token: str | None) -> None:
    _state["url"], _state["token"] = url, token


def client() -> Client:
    return Client(_state["url"], _state["token"])


def wait_operation(c: Client, op_id: int, *, timeout_s: float = 3600, quiet: bool = False) -> dict[str, Any]:
    """Poll an operation until it finishes, with a progress bar; bounded by ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    op: dict[str, Any] = c.get(f"/api/v1/operations/{op_id}")
    with Progress(
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        disable=quiet,
        transient=False,
    ) as bar:
        task = bar.add_task(f"{op['kind']} #{op_id}", total=op["progress_total"] or None)
        while op["state"] in ("pending", "running"):
            if time.monotonic() > deadline:
                raise CliError(f"operation {op_id} still {op['state']} after {timeout_s:.0f}s")
            time.sleep(0.3)
            op = c.get(f"/api/v1/operations/{op_id}")
            bar.update(task, completed=op["progress_done"], total=op["progress_total"] or None)
        bar.update(task, completed=op["progress_done"])
    return op


def show_operation(op: dict[str, Any], as_json: bool) -> None:
    """An operation's per-node results as a table (or JSON), and its error in red."""
    from cli.render import emit_json, out, table

    if as_json:
        emit_json(op)
        return
    results = op.get("results") or {}
    rows = [
        (name, r.get("status"), r.get("message") or r.get("error") or "")
        for name, r in sorted(results.items())
    ]
    # SSH fan-outs retry transient connect failures: show how many attempts a node took when any took more
    attempts = [r.get("attempts") or 1 for _, r in sorted(results.items())]
    if any(a > 1 for a in attempts):
        table(
            f"operation {op['id']} {op['kind']}: {op['state']}",
            ["NODE", "RESULT", "ATTEMPTS", "DETAIL"],
            [
                (name, status, str(a), detail)
                for (name, status, detail), a in zip(rows, attempts, strict=True)
            ],
        )
    else:
        table(f"operation {op['id']} {op['kind']}: {op['state']}", ["NODE", "RESULT", "DETAIL"], rows)
    if op.get("error"):
        out.print(op["error"], style="red")


def print_failure(op: dict[str, Any]) -> None:
    """An operation that did not succeed, as one red line with its reason."""
    reason = op.get("error") or "no reason recorded; see `bcm op show` for its log"
    err.print(
        f"error: operation {op['id']} {op['kind']} {op['state']}: {reason}", style="red", soft_wrap=True
    )


def follow(
    c: Client,
    op_id: int,
    *,
    wait: bool = True,
    as_json: bool = False,
    show: Callable[[dict[str, Any], bool], None] = show_operation,
) -> None:
    """Follow a started operation to its end and show it; exit 1 unless it succeeded.

    A failed operation without per-node results shows its reason instead of an empty table.
    """
    from cli.render import emit_json, out

    if not wait:
        emit_json({"operation_id": op_id}) if as_json else out.print(f"started operation {op_id}")
        return
    op = wait_operation(c, op_id, quiet=as_json)
    if op["state"] != "succeeded" and not op.get("results") and not as_json:
        print_failure(op)  # where the (empty) results table would be
        raise typer.Exit(1)
    show(op, as_json)
    if op["state"] != "succeeded":
        raise typer.Exit(1)
