"""`bcm health …`: the cluster's GPU health summary, failing nodes, a node's GPUs, events, a live view."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from cli.client import Client, CliError
from cli.common import JsonOpt, client
from cli.render import emit_json, err, out, safe, table

app = typer.Typer(
    help="GPU health: summary (no subcommand), nodes, gpus, events, watch.",
    invoke_without_command=True,
    no_args_is_help=False,
)
COLOUR = {"OK": "green", "WARN": "yellow", "FAIL": "red", "UNKNOWN": "bright_black"}
_RELATIVE = re.compile(r"^(\d+)([smhd])$")


def since_param(value: str | None) -> str | None:
    """``10m``, ``2h``, ``1d`` (ago) or an ISO time, as the ISO time the API takes."""
    if value is None:
        return None
    m = _RELATIVE.match(value.strip())
    if m:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m.group(2)]
        return (datetime.now(UTC) - timedelta(**{unit: int(m.group(1))})).isoformat()
    try:
        return datetime.fromisoformat(value).isoformat()
    except ValueError:
        raise CliError(f"--since: give an ISO time or an age like 10m, 2h, 1d (not {value!r})") from None


def _v(verdict: str | None) -> Text:
    v = verdict or "UNKNOWN"
    return safe(v, style=COLOUR.get(v, "white"))


def summary_renderable(s: dict[str, Any], failing: list[dict[str, Any]]) -> Group:
    head = Table(show_header=True, header_style="bold", box=None)
    for col in ("", "TOTAL", "OK", "WARN", "FAIL", "UNKNOWN"):
        head.add_column(col, justify="right" if col else "left")
    nv, gv = s["nodes_by_verdict"], s["gpus_by_verdict"]
    head.add_row("nodes", str(s["nodes"]), *(str(nv.get(k, 0)) for k in ("OK", "WARN", "FAIL", "UNKNOWN")))
    head.add_row("gpus", str(s["gpus"]), *(str(gv.get(k, 0)) for k in ("OK", "WARN", "FAIL", "UNKNOWN")))
    note = (
        f"never reported: {s['nodes_never_reported']}   stale: {s['nodes_stale']}   "
        f"drained by bcm: {s['nodes_drained_by_bcm']}   at {s['generated_at']}"
    )
    parts: list[Any] = [head, note]
    if failing:
        t = Table(title="failing nodes", header_style="bold")
        for col in ("NODE", "VERDICT", "STATE", "DRAINED BY BCM", "REASON"):
            t.add_column(col, overflow="fold")
        for n in failing:
            reason = n.get("drain_reason") or "; ".join(f["message"] for f in n["findings"])[:100]
            t.add_row(
                n["name"],
                _v(n["verdict"]),
                n["provision_state"],
                "yes" if n["drained_by_bcm"] else "",
                reason,
            )
        parts.append(t)
    return Group(*parts)


def _fetch(c: Client) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    s = c.get("/api/v1/health")
    failing = c.get("/api/v1/health/nodes", verdict="fail", limit=50)["items"] if s["failing"] else []
    return s, failing


@app.callback()
def summary(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """The cluster's GPU health: nodes and GPUs by verdict, and the failing nodes."""
    if ctx.invoked_subcommand is not None:
        return
    s, failing = _fetch(client())
    if as_json:
        emit_json({"summary": s, "failing": failing})
        return
    out.print(summary_renderable(s, failing))


@app.command("nodes")
def nodes(
    verdict: Annotated[str | None, typer.Option(help="ok, warn, fail or unknown")] = None,
    hostlist: Annotated[str | None, typer.Argument(help="hostlist filter")] = None,
    limit: Annotated[int, typer.Option(help="at most this many rows")] = 1000,
    as_json: JsonOpt = False,
) -> None:
    """Nodes with their GPU health verdict."""
    page = client().get("/api/v1/health/nodes", verdict=verdict, nodes=hostlist, limit=min(limit, 1000))
    if as_json:
        emit_json(page["items"])
        return
    rows = [
        (
            n["name"],
            _v(n["verdict"]),
            n["provision_state"],
            n["last_report_at"] or "never",
            "stale" if n["stale"] else "",
            "yes" if n["drained_by_bcm"] else "",
            (n.get("drain_reason") or "; ".join(f["message"] for f in n["findings"]))[:80],
        )
        for n in page["items"]
    ]
    table(None, ["NODE", "VERDICT", "STATE", "LAST REPORT", "", "DRAINED BY BCM", "WHY"], rows)
    if page["total"] > len(page["items"]):
        err.print(f"{len(page['items'])} of {page['total']} shown")


@app.command("gpus")
def gpus(node: str, as_json: JsonOpt = False) -> None:
    """A node's GPUs: latest readings and verdicts."""
    items = client().get(f"/api/v1/nodes/{node}/gpus")
    if as_json:
        emit_json(items)
        return
    rows = [
        (
            g["index"],
            g["uuid"],
            g["name"],
            _v(g["verdict"]),
            g["temperature_c"],
            g["power_draw_w"],
            g["utilization_gpu_pct"],
            g["last_xid"] or "",
            "; ".join(r["message"] for r in g["reasons"] if r["severity"] != "OK")[:80],
        )
        for g in items
    ]
    table(None, ["GPU", "UUID", "MODEL", "VERDICT", "TEMP C", "POWER W", "UTIL %", "LAST XID", "WHY"], rows)


@app.command("events")
def events(
    since: Annotated[str | None, typer.Option(help="ISO time or an age such as 10m, 2h, 1d")] = None,
    node: Annotated[str | None, typer.Option(help="only this node")] = None,
    severity: Annotated[str | None, typer.Option(help="ok, warn, fail or unknown")] = None,
    limit: Annotated[int, typer.Option(help="at most this many (newest first)")] = 100,
    as_json: JsonOpt = False,
) -> None:
    """Health events: Xids, verdict changes, drains and resumes (newest first)."""
    items = client().get(
        "/api/v1/health/events",
        since=since_param(since),
        node=node,
        severity=severity,
        limit=min(limit, 1000),
    )
    if as_json:
        emit_json(items)
        return
    rows = [
        (
            e["time"],
            e["node"],
            e["gpu_index"] if e["gpu_index"] is not None else "",
            _v(e["severity"]),
            e["code"],
            e["action"] or "",
            e["message"],
        )
        for e in items
    ]
    table(None, ["TIME", "NODE", "GPU", "SEVERITY", "CODE", "ACTION", "MESSAGE"], rows)


@app.command("watch")
def watch(
    interval: Annotated[float, typer.Option(help="seconds between refreshes", min=0.2)] = 5.0,
    count: Annotated[int, typer.Option(help="stop after this many refreshes (0: until Ctrl-C)", min=0)] = 0,
) -> None:
    """A live summary, refreshed every --interval seconds until Ctrl-C (or --count refreshes)."""
    c = client()
    done = 0
    try:
        with Live(summary_renderable(*_fetch(c)), console=out, auto_refresh=False) as live:
            done = 1
            while count == 0 or done < count:
                time.sleep(interval)
                live.update(summary_renderable(*_fetch(c)), refresh=True)
                done += 1
    except KeyboardInterrupt:
        pass
