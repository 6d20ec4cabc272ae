"""`bcm backup FILE` and `bcm restore FILE`: local admin commands on the head node, like `bcm serve` (they read
the state directory and database URL from the same settings; nothing goes through the API)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.client import CliError
from cli.render import err, out


def _settings():  # type: ignore[no-untyped-def]
    from pydantic import ValidationError

    from bcm.settings import Settings

    try:
        return Settings()
    except ValidationError as exc:
        first = exc.errors()[0]
        raise CliError(
            f"setting BCM_{'__'.join(str(p) for p in first['loc']).upper()}: {first['msg']}"
        ) from None


def _say(line: str) -> None:
    err.print(line, markup=False, highlight=False, soft_wrap=True)


def backup(
    file: Annotated[Path, typer.Argument(help="the archive to write (a .tar.gz, made 0600)")],
    images: Annotated[
        bool,
        typer.Option("--images", help="include the images' files (default: their names and hashes only)"),
    ] = False,
    env_file: Annotated[
        Path | None,
        typer.Option(help="the settings file to include (default: /etc/bcm/bcm.env when it exists)"),
    ] = None,
    timeout: Annotated[float, typer.Option(help="seconds pg_dump may take", min=1, max=86400)] = 3600,
    force: Annotated[bool, typer.Option(help="replace an existing FILE")] = False,
) -> None:
    """Back up this head node: database, secrets (secret.key, SSH keys, WLM credentials, admin token),
    settings, and images by reference (or their files with --images). bcm may be running or stopped."""
    from bcm.backup import create

    if file.exists() and not force:
        raise CliError(f"{file} exists; --force replaces it")
    manifest = create(_settings(), file, images=images, env_file=env_file, timeout_s=timeout, say=_say)
    members = manifest["members"]
    size = file.stat().st_size
    out.print(
        f"wrote {file} ({size / 1e6:.1f} MB): {manifest['database']} database at schema"
        f" {', '.join(manifest['schema'])}, {sum(1 for m in members if m.startswith('state/'))} state files,"
        f" {len(manifest['images'])} image version(s) {'with their files' if images else 'by reference'}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


def restore(
    file: Annotated[Path, typer.Argument(help="an archive `bcm backup` wrote")],
    force: Annotated[
        bool,
        typer.Option(help="restore into a state directory that is not empty (its files are overwritten)"),
    ] = False,
    env_file: Annotated[
        Path, typer.Option(help="where the backup's settings file goes (kept if it exists and differs)")
    ] = Path("/etc/bcm/bcm.env"),
    timeout: Annotated[float, typer.Option(help="seconds pg_restore may take", min=1, max=86400)] = 3600,
    secrets_only: Annotated[
        bool,
        typer.Option(
            "--secrets-only",
            help="only the state directory's files (secret.key, ssh/, wlm/, admin.token): a second head on the"
            " same database",
        ),
    ] = False,
) -> None:
    """Restore a backup into an empty state directory and an empty database (BCM_STATE_DIR,
    BCM_DATABASE_URL), then start `bcm serve` (it upgrades an older schema)."""
    from bcm.backup import restore as run

    done = run(
        _settings(),
        file,
        force=force,
        env_file=env_file,
        timeout_s=timeout,
        secrets_only=secrets_only,
        say=_say,
    )
    m = done.manifest
    out.print(
        f"restored {file} (bcm {m.get('bcm_version')}, {m.get('created_at')}): database {done.database},"
        f" {done.files} files",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    for note in done.notes:
        _say(note)
    if done.images_missing:
        _say(
            f"images by reference, files not restored: {', '.join(done.images_missing)}; copy their directories"
            " under the state directory's images/ from the old head, or build them again"
        )
