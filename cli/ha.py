"""`bcm ha status`: the servers on this database, the leader and its epoch, the operations each holds."""

from __future__ import annotations

from typing import Any

import typer

from cli.common import JsonOpt, client
from cli.render import emit_json, out, table

app = typer.Typer(
    help="Several servers: who leads (dnsmasq, provisioning, sync), who is alive.", no_args_is_help=True
)


def _age(now: str, then: str | None) -> str:
    from datetime import datetime

    if not then:
        return "-"
    seconds = (datetime.fromisoformat(now) - datetime.fromisoformat(then)).total_seconds()
    return f"{seconds:.1f}s ago" if seconds >= 0 else f"in {-seconds:.1f}s"


@app.command("status")
def status(as_json: JsonOpt = False) -> None:
    """Servers (address, version, heartbeat), the leader and its fencing epoch, operations held."""
    s: dict[str, Any] = client().get("/api/v1/ha")
    if as_json:
        emit_json(s)
        return
    lease, now = s["leader"], s["now"]
    if lease["holder"]:
        out.print(
            f"leader: {lease['holder']} at {lease['address'] or '?'}, epoch {lease['epoch']}, "
            f"lease expires {_age(now, lease['expires_at'])}"
        )
    else:
        out.print(f"leader: none (last epoch {lease['epoch']}); the next server to look takes the lease")
    table(
        None,
        ["SERVER", "ADDRESS", "VERSION", "HEARTBEAT", "ALIVE", "LEADER", "OPERATIONS"],
        [
            (
                srv["id"],
                srv["address"],
                srv["version"],
                _age(now, srv["heartbeat_at"]),
                "yes" if srv["alive"] else "no",
                "yes" if srv["leader"] else "",
                srv["operations"],
            )
            for srv in s["servers"]
        ],
    )
    held = [o for o in s["operations"] if o.get("owner")]
    if held:
        table(
            "operations held",
            ["ID", "KIND", "STATE", "OWNER", "LEASE"],
            [(o["id"], o["kind"], o["state"], o["owner"], _age(now, o["lease_expires"])) for o in held],
        )
