"""`bcm token …`: API tokens (admin only)."""

from __future__ import annotations

from typing import Annotated

import typer

from cli.common import JsonOpt, client
from cli.render import emit_json, err, out, table

app = typer.Typer(help="API tokens: create (shown once), list, revoke.", no_args_is_help=True)


@app.command("create")
def create(
    name: str,
    role: Annotated[str, typer.Option(help="admin, operator or viewer")] = "viewer",
    user: Annotated[str | None, typer.Option(help="owner; the role may not exceed theirs")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a token; its secret is printed once."""
    tok = client().post("/api/v1/tokens", {"name": name, "role": role, "user": user})
    if as_json:
        emit_json(tok)
        return
    err.print(f"token {tok['id']} ({tok['role']}) for {tok['name']}; store it now, it is not shown again:")
    out.print(tok["token"])


@app.command("list")
def list_tokens(
    all_: Annotated[bool, typer.Option("--all", help="include revoked")] = False, as_json: JsonOpt = False
) -> None:
    """List tokens (never their secrets)."""
    toks = client().get("/api/v1/tokens", include_revoked=all_)
    if as_json:
        emit_json(toks)
        return
    table(
        None,
        ["ID", "NAME", "USER", "ROLE", "PREFIX", "CREATED", "LAST USED", "REVOKED"],
        [
            (
                t["id"],
                t["name"],
                t.get("user"),
                t["role"],
                t["prefix"] + "…",
                t["created_at"],
                t["last_used_at"],
                t["revoked_at"],
            )
            for t in toks
        ],
    )


@app.command("revoke")
def revoke(token_id: int) -> None:
    """Revoke a token; it stops working at once."""
    tok = client().delete(f"/api/v1/tokens/{token_id}")
    out.print(f"revoked token {tok['id']} ({tok['name']})")
