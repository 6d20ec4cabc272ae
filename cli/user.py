"""`bcm user …`: people who hold API tokens (admin only)."""

from __future__ import annotations

from typing import Annotated

import typer

from cli.common import JsonOpt, client
from cli.render import emit_json, out, table

app = typer.Typer(
    help="Users: own API tokens; a token never has more rights than its user.", no_args_is_help=True
)


@app.command("add")
def add(
    name: str,
    role: Annotated[
        str,
        typer.Option(help="admin, operator, viewer, or user (only what department/project bindings give)"),
    ] = "viewer",
    full_name: Annotated[str | None, typer.Option()] = None,
) -> None:
    """Create a user."""
    client().post("/api/v1/users", {"name": name, "role": role, "full_name": full_name})
    out.print(f"created user {name} ({role}); give them a token with `bcm token create NAME --user {name}`")


@app.command("list")
def list_users(as_json: JsonOpt = False) -> None:
    """List users."""
    users = client().get("/api/v1/users")
    if as_json:
        emit_json(users)
        return
    table(
        None,
        ["NAME", "ROLE", "FULL NAME", "TOKENS", "CREATED"],
        [(u["name"], u["role"], u["full_name"], u["tokens"], u["created_at"]) for u in users],
    )


@app.command("rm")
def remove(name: str) -> None:
    """Remove a user; their tokens stop working at once."""
    client().delete(f"/api/v1/users/{name}")
    out.print(f"removed user {name} and their tokens")
