"""`bcm pxe show|enable|disable`: the head node's PXE service (dnsmasq DHCP/TFTP, iPXE scripts over HTTP)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from cli.client import CliError
from cli.common import JsonOpt, client
from cli.render import emit_json, kv

app = typer.Typer(
    help="PXE: DHCP/TFTP by dnsmasq (supervised by bcm serve) and the boot scripts.", no_args_is_help=True
)


def _show(st: dict[str, Any], as_json: bool) -> None:
    if as_json:
        emit_json(st)
        return
    kv(
        "PXE",
        [
            ("enabled", st["enabled"]),
            ("set by", st["source"]),
            ("interface", st["interface"]),
            ("address", st["address"]),
            ("mode", st["mode"]),
            ("range", f"{st['range_start']} - {st['range_end']}" if st["range_start"] else None),
            ("netmask", st["netmask"]),
            ("router", st["router"] or "none handed out"),
            ("boot scripts", f"{st['server_url']}/boot/v1/ipxe/boot.ipxe"),
            (
                "dnsmasq",
                f"pid {st['dnsmasq_pid']}, restarted {st['dnsmasq_restarts']}x"
                if st["dnsmasq_pid"]
                else "not running",
            ),
        ],
    )


@app.command("show")
def show(as_json: JsonOpt = False) -> None:
    """What PXE serves now, and whether dnsmasq runs."""
    _show(client().get("/api/v1/pxe"), as_json)


@app.command("enable")
def enable(
    interface: Annotated[str | None, typer.Option(help="the provisioning interface dnsmasq serves")] = None,
    address: Annotated[
        str | None, typer.Option(help="this head node's address on it (nodes fetch from here)")
    ] = None,
    dhcp_range: Annotated[
        str | None, typer.Option("--range", help="addresses handed out, FIRST-LAST (dhcp mode)")
    ] = None,
    mode: Annotated[str | None, typer.Option(help="dhcp, or proxy beside another DHCP server")] = None,
    netmask: Annotated[str | None, typer.Option()] = None,
    router: Annotated[str | None, typer.Option(help="default gateway handed out (none by default)")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Serve PXE on an interface; dnsmasq checks the config before it replaces the running one."""
    body: dict[str, Any] = {"enabled": True}
    if dhcp_range is not None:
        first, sep, last = dhcp_range.partition("-")
        if not sep or not first or not last:
            raise CliError(f"--range: {dhcp_range!r} is not FIRST-LAST (like 198.18.0.100-198.18.0.150)")
        body |= {"range_start": first.strip(), "range_end": last.strip()}
    for key, value in (
        ("interface", interface),
        ("address", address),
        ("mode", mode),
        ("netmask", netmask),
        ("router", router),
    ):
        if value is not None:
            body[key] = value
    _show(client().request("PUT", "/api/v1/pxe", json=body), as_json)


@app.command("disable")
def disable(as_json: JsonOpt = False) -> None:
    """Stop serving PXE (dnsmasq stops; the settings are kept for the next enable)."""
    _show(client().request("PUT", "/api/v1/pxe", json={"enabled": False}), as_json)
