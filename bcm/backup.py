"""`bcm backup FILE` and `bcm restore FILE`: a head node's state in one archive, and back.

These are local admin commands on the head node, like ``bcm serve`` itself: they read the state directory
and the database URL from the same settings (``BCM_STATE_DIR``, ``BCM_DATABASE_URL``) and never go through
the API. A backup needs bcm neither running nor stopped: SQLite is copied with its online backup API
(a consistent snapshot while the server writes), PostgreSQL with ``pg_dump`` (one transaction's snapshot).

The archive is a gzip-compressed tar, created 0600 under a temporary name and renamed into place, holding:

    manifest.json            format, bcm version, schema revision, database kind, when, what, sha256 of each member
    database/bcm.sqlite      the SQLite database, or database/bcm.pgdump (pg_dump -Fc) for PostgreSQL
    state/...                the state directory's files: secret.key (BMC passwords, host keys), admin.token,
                             ssh/ (the server's key), wlm/ (workload-manager credentials, their CA), and anything
                             else it holds, except what bcm makes again at start (pxe/, ansible/, locks) and images/
    settings/bcm.env         the settings file, when there is one
    images/<name>/<version>/ only with --images; otherwise the manifest names each image version and its hashes

Restore goes into an empty state directory and an empty database and refuses, in one line, an archive that
does not match its manifest, whose schema is newer than this bcm knows, or of the other database kind. An
older schema is fine: ``bcm serve`` migrates it at start. No password is ever put on a command line: pg_dump
and pg_restore get the URL's connection parameters in their environment (PGPASSWORD).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import IO, Any
from urllib.parse import quote, unquote

from bcm import __version__
from bcm.errors import BcmError
from bcm.settings import Settings

FORMAT = "bcm-backup/1"
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
SQLITE_MEMBER = "database/bcm.sqlite"
PGDUMP_MEMBER = "database/bcm.pgdump"
ENV_MEMBER = "settings/bcm.env"
DEFAULT_ENV_FILE = Path("/etc/bcm/bcm.env")
# in the state directory but made again by `bcm serve` (or only a run's scratch): never backed up
SKIP_TOP = frozenset({"pxe", "ansible", "images", "leader.beat"})
CHUNK = 1 << 20

Say = Callable[[str], None]


class BackupError(BcmError):
    """One readable line: the CLI prints it and exits 1."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


# ---- the database URL -------------------------------------------------------------------------------------


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL (None for PostgreSQL); an in-memory database cannot be backed up."""
    if not url.startswith("sqlite"):
        return None
    path = url.split("///", 1)[-1].split("?", 1)[0] if "///" in url else ""
    if not path or path == ":memory:":
        raise BackupError(f"database {url}: only a SQLite file or PostgreSQL can be backed up")
    return Path(path)


@dataclass(frozen=True)
class PgTarget:
    env: dict[str, str]  # libpq's variables: host, port, user, password, database, options
    schema: str | None  # the URL's search_path, when it names one (else the database's own, public)
    display: str  # the URL without its password


def pg_target(url: str) -> PgTarget:
    """libpq environment for a ``postgresql[+driver]://`` URL: the password goes in PGPASSWORD, never argv."""
    from sqlalchemy.engine import make_url

    u = make_url(url)
    env = {"PGCONNECT_TIMEOUT": "10"}
    for var, value in (
        ("PGHOST", u.host),
        ("PGPORT", u.port),
        ("PGUSER", u.username),
        ("PGPASSWORD", u.password),
        ("PGDATABASE", u.database),
    ):
        if value is not None and value != "":
            env[var] = str(value)
    schema = None
    query = {k: (v if isinstance(v, str) else v[-1]) for k, v in u.query.items()}
    for key, var in (
        ("sslmode", "PGSSLMODE"),
        ("sslrootcert", "PGSSLROOTCERT"),
        ("sslcert", "PGSSLCERT"),
        ("sslkey", "PGSSLKEY"),
        ("port", "PGPORT"),
        ("target_session_attrs", "PGTARGETSESSIONATTRS"),
        ("options", "PGOPTIONS"),
        ("application_name", "PGAPPNAME"),
        ("passfile", "PGPASSFILE"),
        ("service", "PGSERVICE"),
    ):
        if key in query:
            env[var] = unquote(query[key])
    hosts = u.query.get("host")
    if hosts:  # host=db1:5432&host=db2:5432 (several servers, the URL bcm's HA section shows): libpq's lists
        pairs = [
            h.rsplit(":", 1) if ":" in h else [h, ""] for h in ([hosts] if isinstance(hosts, str) else hosts)
        ]
        env["PGHOST"] = ",".join(unquote(h) for h, _ in pairs)
        if any(p for _, p in pairs):
            env["PGPORT"] = ",".join(p or str(u.port or 5432) for _, p in pairs)
    options = env.get("PGOPTIONS", "")
    for word in options.replace("-c ", "-c").split():
        if word.startswith("-csearch_path="):
            first = word.split("=", 1)[1].split(",")[0].strip().strip('"')
            schema = first or None
    return PgTarget(env, schema, u.render_as_string(hide_password=True))


def _pg_env(target: PgTarget) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    return base | target.env


def _run(
    argv: list[str], env: dict[str, str], timeout_s: float, what: str
) -> subprocess.CompletedProcess[str]:
    """A bounded child (pg_dump, pg_restore): its last error line, never its environment, in the failure."""
    if shutil.which(argv[0]) is None:
        raise BackupError(f"{argv[0]} is not installed (Debian: postgresql-client); it is needed to {what}")
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise BackupError(f"{argv[0]} did not finish within {timeout_s:.0f} s (--timeout)") from None
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        raise BackupError(f"{argv[0]} failed to {what}: {lines[-1] if lines else f'exit {done.returncode}'}")
    return done


def _engine(url: str) -> Any:
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    args = {"connect_timeout": 10} if not url.startswith("sqlite") else {}
    return create_engine(url, poolclass=NullPool, connect_args=args)


@contextlib.contextmanager
def _connected(url: str, what: str, label: str | None = None) -> Iterator[Any]:
    """A connection to ``url``; a database error becomes one line naming the database (without its password)."""
    from sqlalchemy import exc as sa_exc

    engine = _engine(url)
    try:
        with engine.connect() as conn:
            yield conn
    except sa_exc.DBAPIError as exc:
        first = (str(exc.orig).strip().splitlines() or ["?"])[0]
        raise BackupError(f"cannot {what} in the database {label or _shown(url)}: {first}") from None
    finally:
        engine.dispose()


def _tables(url: str) -> list[str]:
    """The tables the URL's schema holds (the default schema: the search_path's first, or public)."""
    from sqlalchemy import inspect

    with _connected(url, "list the tables") as conn:
        return sorted(inspect(conn).get_table_names())


def _revision(url: str, label: str | None = None) -> list[str]:
    """The schema revision (Alembic's); a database bcm never started on has none."""
    from sqlalchemy import text

    with _connected(url, "read the schema revision (has bcm serve ever started on it?)", label) as conn:
        return sorted(r[0] for r in conn.execute(text("SELECT version_num FROM alembic_version")))


def _shown(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def known_revisions() -> set[str]:
    from alembic.script import ScriptDirectory

    from bcm.db import alembic_config

    return {s.revision for s in ScriptDirectory.from_config(alembic_config("sqlite://")).walk_revisions()}


# ---- what goes in -----------------------------------------------------------------------------------------


@dataclass
class Member:
    name: str  # its path in the archive
    source: Path
    mode: int = 0o600
    sha256: str = ""
    size: int = 0


@dataclass
class Plan:
    members: list[Member] = field(default_factory=list)
    images: list[dict[str, Any]] = field(default_factory=list)


def _digest(path: Path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _state_files(state_dir: Path, db_file: Path | None) -> Iterator[tuple[str, Path]]:
    """(relative path, file) for each file of the state directory a restore needs."""
    skip = set()
    if db_file is not None:
        for suffix in ("", "-wal", "-shm", "-journal", ".server-lock"):
            skip.add(db_file.with_name(db_file.name + suffix).resolve())
    for root, dirs, files in os.walk(state_dir):
        rel_root = Path(root).relative_to(state_dir)
        if rel_root == Path("."):
            dirs[:] = [d for d in dirs if d not in SKIP_TOP and not d.startswith(".restore-")]
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            rel = rel_root / name
            if rel_root == Path(".") and name in SKIP_TOP:
                continue
            if path.resolve() in skip or path.is_symlink() or not path.is_file():
                continue
            yield rel.as_posix(), path


def _image_rows(url: str) -> list[dict[str, Any]]:
    """Every image version the database names, with its artifacts' hashes (the images' manifest)."""
    from sqlalchemy import text

    with _connected(url, "list the images") as conn:
        versions = conn.execute(
            text("SELECT id, name, version, state, is_current FROM image ORDER BY name, id")
        )
        rows = [dict(r._mapping) for r in versions]
        arts = conn.execute(text("SELECT image_id, kind, filename, size, sha256 FROM imageartifact"))
        by_image: dict[int, list[dict[str, Any]]] = {}
        for a in arts:
            by_image.setdefault(a.image_id, []).append(
                {"kind": a.kind, "filename": a.filename, "size": a.size, "sha256": a.sha256}
            )
    return [
        {
            "name": r["name"],
            "version": r["version"],
            "state": r["state"],
            "current": bool(r["is_current"]),
            "artifacts": sorted(by_image.get(r["id"], []), key=lambda a: a["filename"]),
        }
        for r in rows
    ]


def create(
    settings: Settings,
    dest: Path,
    *,
    images: bool = False,
    env_file: Path | None = None,
    timeout_s: float = 3600,
    say: Say = lambda _line: None,
) -> dict[str, Any]:
    """Write the backup archive ``dest`` (0600, atomically); returns its manifest."""
    state_dir = settings.state_dir
    url = settings.effective_database_url
    db_file = sqlite_path(url)
    if not state_dir.is_dir():
        raise BackupError(f"no state directory at {state_dir} (is BCM_STATE_DIR right?)")
    if db_file is not None and not db_file.is_file():
        raise BackupError(f"no database at {db_file} (is BCM_STATE_DIR or BCM_DATABASE_URL right?)")
    dest = dest.absolute()
    if dest.is_dir():
        raise BackupError(f"{dest} is a directory; name the archive file")
    if not dest.parent.is_dir():
        raise BackupError(f"{dest.parent} does not exist")
    with contextlib.suppress(ValueError):
        dest.relative_to(state_dir.absolute())
        raise BackupError(f"{dest} is inside the state directory {state_dir}; put the backup elsewhere")
    work = Path(tempfile.mkdtemp(prefix=".bcm-backup-", dir=dest.parent))  # 0700, beside the archive
    try:
        plan = Plan()
        if db_file is not None:
            copy = work / "bcm.sqlite"
            _sqlite_backup(db_file, copy)
            schema = _revision(f"sqlite:///{copy}", str(db_file))
            plan.members.append(Member(SQLITE_MEMBER, copy))
            kind, pg_schema = "sqlite", None
            image_url = f"sqlite:///{copy}"
        else:
            target = pg_target(url)
            schema = _revision(url)
            dump = work / "bcm.pgdump"
            argv = ["pg_dump", "--format=custom", "--no-owner", "--no-privileges", f"--file={dump}"]
            if target.schema:
                argv.append(f"--schema={target.schema}")
            say(f"dumping {target.display} with pg_dump")
            _run(argv, _pg_env(target), timeout_s, "dump the database")
            os.chmod(dump, 0o600)
            plan.members.append(Member(PGDUMP_MEMBER, dump))
            kind, pg_schema = "postgresql", target.schema
            image_url = url
        for rel, path in _state_files(state_dir, db_file):
            plan.members.append(Member(f"state/{rel}", path, mode=path.stat().st_mode & 0o777))
        env_path = (
            env_file if env_file is not None else (DEFAULT_ENV_FILE if DEFAULT_ENV_FILE.is_file() else None)
        )
        if env_path is not None:
            if not env_path.is_file():
                raise BackupError(f"option --env-file: {env_path} is not a file")
            plan.members.append(Member(ENV_MEMBER, env_path))
        plan.images = _image_rows(image_url)
        if images:
            for img in plan.images:
                vdir = settings.images_dir / img["name"] / img["version"]
                for art in img["artifacts"]:
                    path = vdir / art["filename"]
                    if path.is_file():
                        plan.members.append(
                            Member(
                                f"images/{img['name']}/{img['version']}/{art['filename']}", path, mode=0o644
                            )
                        )
        for m in plan.members:
            m.sha256, m.size = _digest(m.source)
        manifest = {
            "format": FORMAT,
            "bcm_version": __version__,
            "schema": schema,
            "database": kind,
            "pg_schema": pg_schema,
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "host": socket.gethostname(),
            "images_included": images,
            "images": plan.images,
            "members": {m.name: {"sha256": m.sha256, "size": m.size, "mode": m.mode} for m in plan.members},
        }
        _write_archive(dest, manifest, plan.members)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def _sqlite_backup(src: Path, dst: Path) -> None:
    """SQLite's online backup: a consistent copy while bcm serve may be writing (pages copied in steps)."""
    os.close(os.open(dst, os.O_CREAT | os.O_WRONLY, 0o600))
    try:
        source = sqlite3.connect(f"file:{quote(str(src))}?mode=ro", uri=True, timeout=30)
    except sqlite3.Error as exc:
        raise BackupError(f"cannot open the database {src}: {exc}") from None
    target = sqlite3.connect(dst)
    try:
        source.backup(target, pages=4096)
    except sqlite3.Error as exc:
        raise BackupError(f"cannot copy the database {src}: {exc}") from None
    finally:
        target.close()
        source.close()


class _Hashing(io.RawIOBase):
    """A file read through sha256: what went into the archive is checked against what was planned."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.h, self.n = f, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        self.h.update(data)
        self.n += len(data)
        return data


def _write_archive(dest: Path, manifest: dict[str, Any], members: list[Member]) -> None:
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)  # 0600
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as raw:
            with tarfile.open(fileobj=raw, mode="w:gz", compresslevel=6, format=tarfile.PAX_FORMAT) as tar:
                body = json.dumps(manifest, indent=1, sort_keys=True).encode()
                tar.addfile(_info(MANIFEST, len(body), 0o600), io.BytesIO(body))
                for m in members:
                    with open(m.source, "rb") as f:
                        reader = _Hashing(f)
                        tar.addfile(_info(m.name, m.size, m.mode), reader)
                        if reader.h.hexdigest() != m.sha256 or reader.n != m.size:
                            raise BackupError(
                                f"{m.source} changed while it was backed up; run the backup again"
                            )
            raw.flush()
            os.fsync(raw.fileno())
        os.chmod(tmp, 0o600)
        tmp.replace(dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _info(name: str, size: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.uid, info.gid, info.uname, info.gname = size, mode, 0, 0, "root", "root"
    info.mtime = int(datetime.now(UTC).timestamp())
    return info


# ---- restore ----------------------------------------------------------------------------------------------


def _safe_member(name: str) -> bool:
    p = PurePosixPath(name)
    return (
        not p.is_absolute()
        and ".." not in p.parts
        and str(p) == name
        and len(p.parts) >= 2
        and p.parts[0] in ("database", "state", "settings", "images")
    )


def read_manifest(archive: Path) -> dict[str, Any]:
    """The archive's manifest, checked for form (not yet the members' checksums)."""
    try:
        with tarfile.open(archive, mode="r|*") as tar:
            first = tar.next()
            if first is None or first.name != MANIFEST or not first.isfile():
                raise BackupError(f"{archive} is not a bcm backup: it does not start with {MANIFEST}")
            if first.size > MAX_MANIFEST_BYTES:
                raise BackupError(f"{archive}: its manifest is {first.size} bytes, more than a bcm backup's")
            data = tar.extractfile(first).read()  # type: ignore[union-attr]
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise BackupError(f"{archive} is not a readable bcm backup: {exc}") from None
    return _check_manifest(archive, data)


def _check_manifest(archive: Path, data: bytes) -> dict[str, Any]:
    try:
        manifest = json.loads(data)
    except ValueError:
        raise BackupError(
            f"{archive}: its manifest is not JSON; the archive is damaged or was altered"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BackupError(
            f"{archive}: not a {FORMAT} archive (format {manifest.get('format')!r})"
            if isinstance(manifest, dict)
            else f"{archive}: its manifest is not an object"
        )
    members = manifest.get("members")
    ok = isinstance(members, dict) and all(
        isinstance(k, str)
        and _safe_member(k)
        and isinstance(v, dict)
        and isinstance(v.get("sha256"), str)
        and isinstance(v.get("size"), int)
        and v["size"] >= 0
        and isinstance(v.get("mode"), int)
        for k, v in members.items()
    )
    schema = manifest.get("schema")
    schema_ok = isinstance(schema, list) and all(isinstance(r, str) for r in schema)
    if not ok or manifest.get("database") not in ("sqlite", "postgresql") or not schema_ok:
        raise BackupError(
            f"{archive}: its manifest does not match a bcm backup's; the archive is damaged or was altered"
        )
    db_member = SQLITE_MEMBER if manifest["database"] == "sqlite" else PGDUMP_MEMBER
    if not isinstance(members, dict) or db_member not in members:
        raise BackupError(
            f"{archive}: its manifest lists no {db_member}; the archive is damaged or was altered"
        )
    return manifest


@dataclass
class Restored:
    manifest: dict[str, Any]
    files: int
    database: str
    images_missing: list[str]
    notes: list[str]


def _is_empty(state_dir: Path) -> bool:
    return not state_dir.exists() or not any(state_dir.iterdir())


def _server_running(db_file: Path) -> str | None:
    lock = db_file.with_name(db_file.name + ".server-lock")
    if not lock.exists():
        return None
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
    finally:
        os.close(fd)
    return None


def restore(
    settings: Settings,
    archive: Path,
    *,
    force: bool = False,
    env_file: Path = DEFAULT_ENV_FILE,
    timeout_s: float = 3600,
    secrets_only: bool = False,
    say: Say = lambda _line: None,
) -> Restored:
    """Put the archive's state and database back; refuse anything that does not match, in one line.

    ``secrets_only``: the state directory's files alone (a second head on the same database), no database,
    no images, no settings."""
    if not archive.is_file():
        raise BackupError(f"no backup at {archive}")
    manifest = read_manifest(archive)
    unknown = [r for r in manifest["schema"] if r not in known_revisions()]
    if unknown:
        raise BackupError(
            f"the backup's schema {', '.join(unknown)} is newer than this bcm ({__version__}) knows; restore it"
            f" with bcm {manifest.get('bcm_version', '?')} or later"
        )
    state_dir = settings.state_dir
    url = settings.effective_database_url
    db_file = sqlite_path(url)
    kind = "sqlite" if db_file is not None else "postgresql"
    if manifest["database"] != kind and not secrets_only:
        raise BackupError(
            f"the backup holds a {manifest['database']} database and BCM_DATABASE_URL is {kind}: restoring across"
            " kinds is not supported; restore into the same kind, then move the data yourself"
        )
    if not _is_empty(state_dir) and not force:
        raise BackupError(
            f"the state directory {state_dir} is not empty; restore into an empty one (--force overwrites)"
        )
    pg = None
    if secrets_only:
        pass
    elif db_file is not None:
        running = _server_running(db_file)
        if running:
            raise BackupError(f"bcm serve ({running}) is using {db_file}; stop it before restoring")
        if db_file.exists() and not force and _tables(f"sqlite:///{db_file}"):
            raise BackupError(f"the database {db_file} already holds tables; restore into an empty database")
    else:
        pg = pg_target(url)
        if (manifest.get("pg_schema") or None) != pg.schema:
            raise BackupError(
                f"the backup is of PostgreSQL schema {manifest.get('pg_schema') or 'public'} and BCM_DATABASE_URL's"
                f" search_path is {pg.schema or 'public'}: restore into the same schema"
            )
        tables = _tables(url)
        if tables:
            raise BackupError(
                f"the database {pg.display} already holds {len(tables)} tables (e.g. {tables[0]});"
                " restore into an empty database"
            )
    created = not state_dir.exists()
    state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)
    need = sum(
        m["size"] for name, m in manifest["members"].items() if not secrets_only or name.startswith("state/")
    )
    free = shutil.disk_usage(state_dir).free
    if need > free:
        if created:
            state_dir.rmdir()
        raise BackupError(
            f"the backup needs {need / 1e6:.0f} MB and {state_dir} has {free / 1e6:.0f} MB free"
        )
    staging = Path(tempfile.mkdtemp(prefix=".restore-", dir=state_dir))
    try:
        _extract(
            archive, manifest, staging, keep=(lambda n: n.startswith("state/")) if secrets_only else None
        )
        say(f"archive checked: {len(manifest['members'])} members match the manifest")
        notes: list[str] = []
        if secrets_only:
            database = "not restored (--secrets-only)"
        elif db_file is not None:
            db_file.parent.mkdir(parents=True, exist_ok=True)
            for suffix in ("-wal", "-shm", "-journal"):
                db_file.with_name(db_file.name + suffix).unlink(missing_ok=True)
            os.replace(staging / SQLITE_MEMBER, db_file)
            os.chmod(db_file, 0o600)
            database = str(db_file)
        else:
            assert pg is not None
            _pg_restore(pg, url, staging / PGDUMP_MEMBER, timeout_s)
            database = pg.display
        files = 0
        for name, meta in sorted(manifest["members"].items()):
            top, _, rel = name.partition("/")
            if top == "state":
                dest = state_dir / rel
            elif top == "images" and not secrets_only:
                dest = settings.images_dir / rel
            else:
                continue
            _place(staging / name, dest, state_dir, meta["mode"])
            files += 1
        if ENV_MEMBER in manifest["members"] and not secrets_only:
            notes.append(_restore_env(staging / ENV_MEMBER, env_file))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            shutil.rmtree(state_dir, ignore_errors=True)
        raise
    shutil.rmtree(staging, ignore_errors=True)
    missing = []
    for img in [] if secrets_only else manifest.get("images") or []:
        vdir = settings.images_dir / img["name"] / img["version"]
        if img.get("state") == "ready" and any(
            not (vdir / a["filename"]).is_file() for a in img["artifacts"]
        ):
            missing.append(f"{img['name']}:{img['version']}")
    return Restored(manifest, files, database, missing, notes)


def _extract(
    archive: Path, manifest: dict[str, Any], staging: Path, keep: Callable[[str], bool] | None = None
) -> None:
    """Every member (those ``keep`` names) into ``staging``, each checked against the manifest's size and
    sha256 as it streams; the others are checked too, and not written."""
    expected: dict[str, dict[str, Any]] = manifest["members"]
    seen: set[str] = set()
    damaged = "the archive is damaged or was altered"
    try:
        with tarfile.open(archive, mode="r|*") as tar:
            for i, info in enumerate(tar):
                if i == 0:  # the manifest, read already
                    continue
                meta = expected.get(info.name)
                if meta is None or not info.isfile() or info.name in seen:
                    raise BackupError(f"{archive}: member {info.name!r} is not in its manifest; {damaged}")
                if info.size != meta["size"]:
                    raise BackupError(
                        f"{archive}: member {info.name} is not the size its manifest says; {damaged}"
                    )
                seen.add(info.name)
                dest = staging / info.name
                h = hashlib.sha256()
                src = tar.extractfile(info)
                assert src is not None
                if keep is None or keep(info.name):
                    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                else:
                    fd = os.open(os.devnull, os.O_WRONLY)
                with os.fdopen(fd, "wb") as out:
                    while chunk := src.read(CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                if h.hexdigest() != meta["sha256"]:
                    raise BackupError(f"{archive}: member {info.name} does not match its checksum; {damaged}")
    except (tarfile.TarError, OSError, EOFError) as exc:
        if isinstance(exc, OSError) and exc.errno is not None:
            raise BackupError(f"cannot restore into {staging.parent}: {exc.strerror}") from None
        raise BackupError(f"{archive} is truncated or not a bcm backup: {exc}") from None
    missing = sorted(set(expected) - seen)
    if missing:
        raise BackupError(f"{archive}: member {missing[0]} of its manifest is missing; {damaged}")


def _place(src: Path, dest: Path, state_dir: Path, mode: int) -> None:
    """Move one file into the state directory; directories made 0700, the file keeps its recorded mode."""
    parts = dest.relative_to(state_dir).parts[:-1]
    d = state_dir
    for part in parts:
        d = d / part
        if not d.exists():
            d.mkdir(mode=0o700)
    os.chmod(src, mode & 0o777)
    os.replace(src, dest)


def _pg_restore(pg: PgTarget, url: str, dump: Path, timeout_s: float) -> None:
    """pg_restore into the URL's database, in one transaction. A dump of a search_path schema is restored into
    that schema, made here when it is missing (its own CREATE SCHEMA is skipped: it may exist, empty)."""
    env = _pg_env(pg)
    argv = ["pg_restore", "--no-owner", "--no-privileges", "--exit-on-error", "--single-transaction"]
    if pg.schema:
        from sqlalchemy import text

        engine = _engine(url)
        try:
            with engine.begin() as conn:
                conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{pg.schema.replace(chr(34), "")}"'))
        finally:
            engine.dispose()
        listing = _run(["pg_restore", "--list", str(dump)], env, timeout_s, "read the dump").stdout
        keep = [ln for ln in listing.splitlines() if f" SCHEMA - {pg.schema} " not in ln]
        lst = dump.with_suffix(".list")
        lst.write_text("\n".join(keep) + "\n")
        argv.append(f"--use-list={lst}")
    dbname = pg.env.get("PGDATABASE")
    argv += [f"--dbname={dbname}"] if dbname else []
    argv.append(str(dump))
    _run(argv, env, timeout_s, "restore the database")


def _restore_env(src: Path, env_file: Path) -> str:
    data = src.read_bytes()
    if env_file.exists():
        if env_file.read_bytes() == data:
            return f"settings: {env_file} is already the backup's"
        beside = env_file.with_name(env_file.name + ".restored")
        _write_private(beside, data)
        return f"settings: kept {env_file} (it differs from the backup's); the backup's is {beside}"
    _write_private(env_file, data)
    return f"settings: wrote {env_file}"


def _write_private(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        raise BackupError(
            f"cannot write {path}: {exc.strerror or exc} (--env-file puts it elsewhere)"
        ) from None
