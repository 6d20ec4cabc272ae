"""`bcm service install`: a systemd unit for `bcm serve` on this head node (a local file, like `bcm serve`
is a local process; nothing goes through the API)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from cli.client import CliError
from cli.render import err, out

app = typer.Typer(help="Run bcm as a systemd service on this head node.", no_args_is_help=True)

DEFAULT_PATH = Path("/etc/systemd/system/bcm.service")
DEFAULT_STATE_DIR = Path("/var/lib/bcm")
DEFAULT_ENV_FILE = Path("/etc/bcm/bcm.env")
TEMPLATE = "service/bcm.service.j2"


def systemd_quote(arg: str) -> str:
    """One ExecStart word: ``%`` doubled (systemd's specifiers), quoted when it holds a space or quote."""
    arg = arg.replace("%", "%%")
    if any(c in arg for c in " \t\"'\\;$"):
        return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return arg


def serve_command() -> list[str]:
    """How this installation starts the server: the ``bcm`` script beside this Python (a virtualenv's
    bin/), else this Python running the CLI module."""
    script = Path(sys.executable).parent / "bcm"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script), "serve"]
    return [sys.executable, "-m", "cli.main", "serve"]


def render_unit(
    *, unit_name: str, state_dir: Path, env_file: Path, cache_dir: Path, log_format: str, command: list[str]
) -> str:
    from bcm.services.render import render

    return render(
        TEMPLATE,
        unit_name=unit_name,
        exec_start=" ".join(systemd_quote(a) for a in command),
        state_dir=state_dir,
        env_file=env_file,
        read_write_paths=[systemd_quote(str(p)) for p in (state_dir, cache_dir)],
        log_format=log_format,
    )


@app.command("install")
def install(
    path: Annotated[Path, typer.Option(help="where the unit goes")] = DEFAULT_PATH,
    state_dir: Annotated[
        Path, typer.Option(help="BCM_STATE_DIR for the service (made 0700)")
    ] = DEFAULT_STATE_DIR,
    env_file: Annotated[
        Path, typer.Option(help="optional file of BCM_*=value settings the service reads")
    ] = DEFAULT_ENV_FILE,
    log_format: Annotated[str, typer.Option(help="text, or json: one JSON object a line")] = "text",
    stdout: Annotated[
        bool, typer.Option("--stdout", "--dry-run", help="print the unit instead of writing anything")
    ] = False,
    force: Annotated[bool, typer.Option(help="replace a different unit already at --path")] = False,
) -> None:
    """Write a hardened systemd unit that runs `bcm serve`, and say how to start it."""
    from bcm.logs import check_format
    from bcm.settings import Settings

    try:
        log_format = check_format(log_format)
    except ValueError as exc:
        raise CliError(f"option --log-format: {exc}") from None
    for name, value in (("--path", path), ("--state-dir", state_dir), ("--env-file", env_file)):
        if not value.is_absolute():
            raise CliError(f"option {name}: {value} is not an absolute path (systemd needs one)")
    if path.suffix != ".service":
        raise CliError(f"option --path: {path} must end in .service")
    unit_name = path.stem
    cache_dir = Settings().images.cache_dir  # the image layer cache (BCM_IMAGES__CACHE_DIR moves it)
    unit = render_unit(
        unit_name=unit_name,
        state_dir=state_dir,
        env_file=env_file,
        cache_dir=cache_dir,
        log_format=log_format,
        command=serve_command(),
    )
    if stdout:
        sys.stdout.write(unit)
        return
    if path.exists() and path.read_text() != unit and not force:
        raise CliError(f"{path} exists and differs; --force replaces it (--stdout shows the new one)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f".{path.name}.new")
        staged.write_text(unit)
        staged.chmod(0o644)
        staged.replace(path)
        # ProtectSystem=strict: the service cannot make these itself, and a ReadWritePaths that is missing
        # stops the start
        state_dir.mkdir(parents=True, exist_ok=True)
        state_dir.chmod(0o700)
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(
            f"cannot write {path}: {exc.strerror or exc} (as root, or --stdout to print it)"
        ) from None
    out.print(f"wrote {path}", markup=False, highlight=False, soft_wrap=True)  # one line, whatever its length
    err.print(
        f"start it now and at every boot:\n  systemctl daemon-reload && systemctl enable --now {unit_name}\n"
        f"settings (BCM_HOST=0.0.0.0, BCM_DATABASE_URL=…) go in {env_file}; logs: journalctl -u {unit_name}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
