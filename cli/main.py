"""`bcm`: the admin CLI. It talks to the server over REST only (and `bcm serve` starts that server)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from cli import (
    agent,
    backup,
    ca,
    category,
    ha,
    health,
    image,
    lab,
    node,
    op,
    power,
    pxe,
    service,
    tenancy,
    token,
    user,
    wlm,
)
from cli.client import CliError
from cli.common import TokenOpt, UrlOpt, configure
from cli.render import err

app = typer.Typer(
    help="bcm: turn bare-metal GPU machines into a working cluster.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,  # tokens and BMC passwords pass through locals
    add_completion=False,
)
app.add_typer(node.app, name="node")
app.add_typer(category.app, name="category")
app.add_typer(op.app, name="op")
app.add_typer(token.app, name="token")
app.add_typer(user.app, name="user")
app.add_typer(lab.app, name="lab")
app.add_typer(health.app, name="health")
app.add_typer(ha.app, name="ha")
app.add_typer(agent.app, name="agent")
app.add_typer(wlm.app, name="wlm")
app.add_typer(power.app, name="power")
app.add_typer(image.app, name="image")
app.add_typer(pxe.app, name="pxe")
app.add_typer(service.app, name="service")
app.add_typer(ca.app, name="ca")
app.add_typer(tenancy.dept_app, name="dept")
app.add_typer(tenancy.project_app, name="project")
app.add_typer(tenancy.tenancy_app, name="tenancy")
node.app.command("token")(agent.node_token)
app.command("backup")(backup.backup)
app.command("restore")(backup.restore)


@app.callback()
def _root(url: UrlOpt = None, token_: TokenOpt = None) -> None:
    configure(url, token_)


@app.command("serve")
def serve(
    host: Annotated[str | None, typer.Option(help="listen address (BCM_HOST)")] = None,
    port: Annotated[int | None, typer.Option(help="listen port (BCM_PORT)")] = None,
    log_level: Annotated[
        str | None,
        typer.Option(help="debug, info, warning or error (BCM_LOG_LEVEL); libraries log only at debug"),
    ] = None,
    log_format: Annotated[
        str | None,
        typer.Option(help="text, or json: one JSON object a line for a log collector (BCM_LOG_FORMAT)"),
    ] = None,
) -> None:
    """Run the head-node server (API, boot files, background work)."""
    from pydantic import ValidationError

    from bcm.server import serve as run
    from bcm.settings import Settings

    overrides = {
        k: v
        for k, v in {"host": host, "port": port, "log_level": log_level, "log_format": log_format}.items()
        if v is not None
    }
    try:
        settings = Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:  # name the option or variable it came from, no traceback
        first = exc.errors()[0]
        loc = [str(part) for part in first["loc"]]
        if loc[0] in overrides:
            raise CliError(f"option --{loc[0].replace('_', '-')}: {first['msg']}") from None
        raise CliError(f"setting BCM_{'__'.join(loc).upper()}: {first['msg']}") from None
    run(settings)


def main() -> None:
    try:
        app()
    except CliError as exc:
        err.print(f"error: {exc}", style="red", soft_wrap=True)
        sys.exit(1)
    except Exception as exc:  # noqa: BLE001 - the edge: one readable line, never a traceback with locals
        from bcm.errors import BcmError

        if isinstance(exc, BcmError):
            err.print(f"error: {exc.message}", style="red", soft_wrap=True)
            sys.exit(1)
        raise


if __name__ == "__main__":
    main()
