"""`bcm backup` and `bcm restore` (#31): a head node's state survives the round trip, on SQLite and PostgreSQL.

A real `bcm serve` is given nodes, a host key pinned by `bcm node trust` against a real sshd on loopback, tokens,
a BMC password for a real IPMI BMC (ipmi_sim on loopback), GPU health history (reports posted with the node's
token) and an image; `bcm backup` copies it while that server runs; the server stops and its database is lost;
`bcm restore` puts everything into an empty state directory and an empty database; a new `bcm serve` there
answers the same API, the old tokens work, bcm's SSH key still logs in while an impostor sshd with another host
key on the node's address is refused (the pin held), and the BMC password still decrypts and still goes only
to its own BMC. Then what restore refuses: a damaged or
altered archive, a newer schema, a non-empty state directory or database, the other database kind.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import sqlite3
import stat
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncssh
import httpx
import pytest
from sqlalchemy import create_engine, text
from sqlmodel import Session

from bcm.agent.collector import collect
from bcm.agent.fake_nvml import FakeNvml
from bcm.db import make_engine
from bcm.devserver import Server
from bcm.drivers import imagebuild
from bcm.lab import bmc
from bcm.lab.fakegpu import RECORDED_NVML
from bcm.services import images as image_svc
from tests.conftest import PG_URL, pg_schema

PASSWORD = "Bmc-pw-bk-31"  # IPMI passwords are at most 16 bytes
# nothing changes by itself between the snapshots: no health report goes stale, no power poll runs
QUIET = {"BCM_HEALTH__INTERVAL_S": "3600", "BCM_POWER__POLL_INTERVAL_S": "0"}
DB_PASSWORD = "Pg-pw-not-on-argv-31"


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def ipmi_bmc(tmp_path: Path) -> Iterator[bmc.BmcSpec]:
    """A real IPMI BMC (ipmi_sim) on loopback, powering a sleeping process."""
    if not (shutil.which("ipmi_sim") and shutil.which("ipmitool")):
        pytest.skip("needs ipmi_sim (openipmi) and ipmitool")
    spec = bmc.BmcSpec(
        "ipmi", "m-backup", "127.0.0.1", free_udp_port(), "admin", PASSWORD, str(tmp_path / "bmc")
    )
    bmc.write_machine(spec, [sys.executable, "-c", "import time; time.sleep(3600)", "machine-{boot}"])
    proc = bmc.start(spec)
    try:
        yield spec
    finally:
        bmc.stop(proc.pid, spec.dir)


SSHD = Path("/usr/sbin/sshd")
ROOT_PASSWORD = "bcm-backup-root-pw"  # only valid inside the test sshds' mount namespaces


def start_sshd(d: Path, address: str, port: int) -> subprocess.Popen[bytes]:
    """A real OpenSSH sshd on ``address:port`` with a host key of its own, in its own mount namespace where
    /root is a temporary home and root's password is ROOT_PASSWORD (as tests/integration/test_ssh_driver.py)."""
    d.mkdir(parents=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_ed25519")], check=True)
    (d / "home" / ".ssh").mkdir(parents=True, mode=0o700)
    hashed = subprocess.run(
        ["openssl", "passwd", "-6", ROOT_PASSWORD], capture_output=True, text=True, check=True
    ).stdout.strip()
    shadow = [
        ":".join([f[0], hashed, *f[2:]]) if f[0] == "root" else ":".join(f)
        for f in (line.split(":") for line in Path("/etc/shadow").read_text().splitlines())
    ]
    (d / "shadow").write_text("\n".join(shadow) + "\n")
    (d / "shadow").chmod(0o600)
    (d / "sshd_config").write_text(
        f"ListenAddress {address}\nPort {port}\nHostKey {d / 'host_ed25519'}\nPidFile none\nUsePAM no\n"
        "StrictModes no\nPermitRootLogin yes\nPubkeyAuthentication yes\nPasswordAuthentication yes\n"
        "KbdInteractiveAuthentication no\nAuthorizedKeysFile .ssh/authorized_keys\nUseDNS no\n"
    )
    inner = (
        "mount -t tmpfs tmpfs /run && mkdir -p /run/sshd && "
        f"mount --bind {d / 'shadow'} /etc/shadow && mount --bind {d / 'home'} /root && "
        f"exec {SSHD} -D -e -f {d / 'sshd_config'}"
    )
    with (d / "sshd.log").open("wb") as log:
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert proc.poll() is None, (d / "sshd.log").read_text()
        try:
            socket.create_connection((address, port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"sshd did not listen on {address}:{port}")


@pytest.fixture
def sshds(tmp_path: Path) -> Iterator[int]:
    """The node's sshd on 127.0.0.1 and an impostor with another host key on 127.0.0.2, on the same port."""
    if os.geteuid() != 0 or not SSHD.exists() or not shutil.which("unshare") or not shutil.which("openssl"):
        pytest.skip("needs root, /usr/sbin/sshd, unshare and openssl")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    procs = []
    try:
        procs.append(start_sshd(tmp_path / "sshd-node", "127.0.0.1", port))
        procs.append(start_sshd(tmp_path / "sshd-impostor", "127.0.0.2", port))
        yield port
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def inventory(c: httpx.Client, node: str) -> dict[str, Any]:
    started = ok(c.post("/api/v1/nodes/actions/inventory", json={"nodes": node}))
    return dict(wait_op(c, started["operation_id"])["results"][node])


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """None (SQLite in the state directory) or a PostgreSQL URL of a schema of its own, with a password in it
    (the test database trusts loopback, so it is never checked, only carried)."""
    if request.param == "sqlite":
        yield None
        return
    with pg_schema() as url:
        yield url.replace("postgres@", f"postgres:{DB_PASSWORD}@", 1)


def api(srv: Server, token: str | None = None) -> httpx.Client:
    return httpx.Client(
        base_url=srv.url, headers={"Authorization": f"Bearer {token or srv.token()}"}, timeout=30
    )


def ok(r: httpx.Response, code: int = 200) -> Any:
    assert r.status_code == code, r.text
    return r.json()


def wait_op(c: httpx.Client, op_id: int) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        op = ok(c.get(f"/api/v1/operations/{op_id}"))
        if op["state"] not in ("pending", "running"):
            return dict(op)
        time.sleep(0.2)
    raise AssertionError(f"operation {op_id} did not finish")


def power_status(c: httpx.Client, node: str) -> dict[str, Any]:
    started = ok(c.post("/api/v1/nodes/actions/power-status", json={"nodes": node}))
    return dict(wait_op(c, started["operation_id"])["results"][node])


def report(host: str) -> bytes:
    nv = FakeNvml.from_file(RECORDED_NVML / "h100_sxm_565.json")
    nv.init()
    try:
        return json.dumps(collect(nv, None, hostname=host)).encode()
    finally:
        nv.shutdown()


def post_report(srv: Server, node_token: str, host: str) -> httpx.Response:
    return httpx.post(
        f"{srv.url}/boot/v1/agent/report",
        content=report(host),
        headers={"Authorization": f"Bearer {node_token}", "Content-Type": "application/json"},
        timeout=30,
    )


def history(c: httpx.Client, node: str, samples: int) -> dict[str, Any]:
    """The first GPU's history once it holds ``samples`` readings (reports are written in the background)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        gpus = ok(c.get(f"/api/v1/nodes/{node}/gpus"))
        if gpus:
            h = ok(c.get(f"/api/v1/gpus/{gpus[0]['uuid']}/history"))
            if len(h["samples"]) >= samples:
                return dict(h)
        time.sleep(0.2)
    raise AssertionError(f"{node}: {samples} health samples were not written")


def publish_image(url: str, images_dir: Path) -> None:
    """Version 1 of image ``img`` from three small files, through the images service a build publishes with
    (an image build itself runs mmdebstrap for minutes: tests/integration/test_image_build.py)."""
    engine = make_engine(url)
    try:
        with Session(engine) as s:
            image = image_svc.begin_build(s, "img", None, "test")
            staging = image_svc.staging_dir(images_dir, "img", image.version, 1)
            staging.mkdir(parents=True)
            found = []
            for kind, filename in (
                ("kernel", "vmlinuz"),
                ("initramfs", "initramfs.img"),
                ("rootfs", "rootfs.squashfs"),
            ):
                data = f"{kind} of img".encode()
                (staging / filename).write_bytes(data)
                found.append(imagebuild.Artifact(kind, filename, len(data), hashlib.sha256(data).hexdigest()))
            image_svc.publish(s, image, staging, images_dir, found, {}, 3)
            s.commit()
    finally:
        engine.dispose()


def snapshot(c: httpx.Client) -> dict[str, Any]:
    """What the round trip must keep, as the API shows it."""
    gpus = ok(c.get("/api/v1/nodes/n1/gpus"))
    return {
        "nodes": ok(c.get("/api/v1/nodes")),
        "n1": ok(c.get("/api/v1/nodes/n1")),
        "gpus": gpus,
        "history": ok(c.get(f"/api/v1/gpus/{gpus[0]['uuid']}/history")),
        "images": ok(c.get("/api/v1/images")),
        "image": ok(c.get("/api/v1/images/img")),
        # each use of a token moves its last_used_at; the rest must be as it was
        "tokens": [{k: v for k, v in t.items() if k != "last_used_at"} for t in ok(c.get("/api/v1/tokens"))],
        "categories": ok(c.get("/api/v1/categories")),
    }


def wipe_database(url: str | None, state: Path) -> None:
    """The database is lost: SQLite's file goes with the state directory; PostgreSQL's schema is emptied."""
    if url is None:
        return
    schema = url.rsplit("%3D", 1)[1]
    engine = create_engine(PG_URL)
    with engine.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    engine.dispose()


def spy_path(tmp_path: Path) -> str:
    """A PATH whose pg_dump and pg_restore record their argv and whether PGPASSWORD was set, then run the real ones."""
    bindir = tmp_path / "spy"
    bindir.mkdir(exist_ok=True)
    for tool in ("pg_dump", "pg_restore"):
        real = shutil.which(tool)
        assert real, f"{tool} is needed for PostgreSQL backups"
        script = bindir / tool
        script.write_text(
            "#!/bin/sh\n"
            f'printf "%s\\n" "{tool} $*" >> "{tmp_path}/argv.log"\n'
            f'[ -n "$PGPASSWORD" ] && echo "{tool} has PGPASSWORD" >> "{tmp_path}/argv.log"\n'
            f'exec "{real}" "$@"\n'
        )
        script.chmod(0o755)
    return f"{bindir}:{os.environ['PATH']}"


def test_round_trip_keeps_the_api_tokens_pins_and_bmc_passwords(
    tmp_path: Path, db: str | None, ipmi_bmc: bmc.BmcSpec, sshds: int
) -> None:
    quiet = QUIET | {"BCM_SSH__PORT": str(sshds), "BCM_SSH__RETRIES": "0"}
    old = Server(tmp_path / "old" / "state", database_url=db, extra_env=quiet)
    old.start()
    try:
        c = api(old)
        ok(c.post("/api/v1/categories", json={"name": "hgx", "description": "HGX H100"}), 201)
        ok(
            c.post(
                "/api/v1/nodes",
                json={
                    "name": "n1",
                    "category": "hgx",
                    "ip": "127.0.0.1",
                    "bmc_address": f"127.0.0.1:{ipmi_bmc.port}",
                    "bmc_protocol": "ipmi",
                    "bmc_user": "admin",
                },
            ),
            201,
        )
        ok(c.post("/api/v1/nodes/bulk", json={"nodes": "n[2-3]"}), 201)
        assert old.cli("power", "set", "n1", "--password-stdin", input=PASSWORD + "\n").returncode == 0
        # the node trusts bcm's SSH key (a root password, once) and bcm pins the node's host key
        trusted = old.cli("node", "trust", "n1", "--password-stdin", input=ROOT_PASSWORD + "\n")
        assert trusted.returncode == 0, trusted.stdout + trusted.stderr
        assert inventory(c, "n1")["status"] == "ok"
        key = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
        ok(c.post("/api/v1/nodes/n2/rekey", json={"ssh_host_key": key}))  # a pin set by an admin
        operator = ok(c.post("/api/v1/tokens", json={"name": "ops", "role": "operator"}), 201)["token"]
        node_token = ok(c.post("/api/v1/nodes/n1/token"), 201)["token"]
        for _ in range(2):
            assert post_report(old, node_token, "n1").status_code == 202
        history(c, "n1", 2)
        publish_image(db or f"sqlite:///{old.state_dir / 'bcm.db'}", old.state_dir / "images")
        assert power_status(c, "n1")["status"] == "ok"
        before = snapshot(c)
        admin = old.token()

        archive = tmp_path / "backups" / "head.tar.gz"
        archive.parent.mkdir()
        made = old.cli("backup", str(archive), PATH=spy_path(tmp_path))  # while the server runs
        assert made.returncode == 0, made.stderr
        assert "wrote" in made.stdout and "1 image version(s) by reference" in made.stdout
    finally:
        old.stop()
    assert stat.S_IMODE(archive.stat().st_mode) == 0o600
    assert sorted(p.name for p in archive.parent.iterdir()) == ["head.tar.gz"]  # no temporary left beside it

    with tarfile.open(archive) as tar:
        names = tar.getnames()
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
    assert names[0] == "manifest.json"
    assert {"state/admin.token", "state/secret.key", "state/ssh/id_ed25519"} <= set(names)
    assert ("database/bcm.sqlite" if db is None else "database/bcm.pgdump") in names
    assert not any(n.startswith(("images/", "state/images")) for n in names)  # images by reference
    assert manifest["images"] == [
        {
            "name": "img",
            "version": "1",
            "state": "ready",
            "current": True,
            "artifacts": [
                {k: a[k] for k in ("kind", "filename", "size", "sha256")}
                for a in sorted(before["image"]["artifacts"], key=lambda a: a["filename"])
            ],
        }
    ]
    assert manifest["database"] == ("sqlite" if db is None else "postgresql")
    assert set(manifest["members"]) == set(names) - {"manifest.json"}
    for secret in (PASSWORD, admin, operator, node_token, DB_PASSWORD):
        assert all(secret not in n for n in names)
        assert secret not in made.stdout + made.stderr
    if db is not None:
        argv = (tmp_path / "argv.log").read_text()
        assert "pg_dump has PGPASSWORD" in argv and DB_PASSWORD not in argv

    # the old head and its database are gone; a new one starts from the backup alone
    wipe_database(db, old.state_dir)
    shutil.rmtree(old.state_dir)
    new = Server(tmp_path / "new" / "state", database_url=db, extra_env=quiet)
    restored = new.cli(
        "restore", str(archive), "--env-file", str(tmp_path / "bcm.env"), PATH=spy_path(tmp_path)
    )
    assert restored.returncode == 0, restored.stderr
    assert "images by reference, files not restored: img:1" in restored.stderr
    for secret in (PASSWORD, admin, operator, node_token, DB_PASSWORD):
        assert secret not in restored.stdout + restored.stderr
    if db is not None:
        assert DB_PASSWORD not in (tmp_path / "argv.log").read_text()
    assert stat.S_IMODE((new.state_dir / "secret.key").stat().st_mode) == 0o600
    assert stat.S_IMODE(new.state_dir.stat().st_mode) == 0o700

    # the image's files, by reference: copied from the old head (here: made again, the same bytes)
    for a in before["image"]["artifacts"]:
        kind = a["kind"]
        path = new.state_dir / "images" / "img" / "1" / a["filename"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"{kind} of img".encode())
    new.start()
    try:
        c = api(new, admin)  # the old admin token
        after = snapshot(c)
        assert after == before
        ops = api(new, operator)
        assert ok(ops.get("/api/v1/nodes/n1"))["name"] == "n1"
        assert post_report(new, node_token, "n1").status_code == 202  # the node's token
        assert len(history(c, "n1", 3)["samples"]) == 3
        # bcm's SSH key and the node's pinned host key came back: the node answers, an impostor is refused
        assert inventory(ops, "n1")["status"] == "ok"
        impostor = [{"name": "eth0", "ip": "127.0.0.2", "boot": True}]
        ok(c.patch("/api/v1/nodes/n1", json={"interfaces": impostor}))
        assert inventory(ops, "n1")["status"] == "host_key_changed"
        # the BMC password decrypts with the restored key and goes to its BMC, through the power path
        result = power_status(ops, "n1")
        assert result["status"] == "ok" and result["power"] == "off", result
        # and only there: pointed at another BMC, it is not sent
        ok(c.patch("/api/v1/nodes/n1", json={"bmc_address": f"127.0.0.1:{free_udp_port()}"}))
        refused = power_status(ops, "n1")
        assert refused["status"] == "no_bmc" and "an admin must set them again" in refused["message"], refused
    finally:
        new.stop()
    assert PASSWORD not in (new.log.read_text() if new.log else "")


# ---- what restore refuses ---------------------------------------------------------------------------------


@pytest.fixture
def made(tmp_path: Path) -> tuple[Server, Path]:
    """A stopped head's state (SQLite) and its backup."""
    srv = Server(tmp_path / "a" / "state")
    srv.start()
    ok(api(srv).post("/api/v1/nodes", json={"name": "n1"}), 201)
    srv.stop()
    archive = tmp_path / "a.tar.gz"
    done = srv.cli("backup", str(archive))
    assert done.returncode == 0, done.stderr
    return srv, archive


def restore(tmp_path: Path, archive: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    target = Server(tmp_path / "b" / "state", extra_env=env)
    return target.cli("restore", str(archive), "--env-file", str(tmp_path / "b.env"), *args)


def refused(done: subprocess.CompletedProcess[str], words: str) -> None:
    assert done.returncode == 1, done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def rewrite(archive: Path, dest: Path, change: Any) -> Path:
    """A copy of the archive with ``change(name, data) -> data | None`` applied to each member (None drops it)."""
    with tarfile.open(archive) as src, tarfile.open(dest, "w:gz") as out:
        for info in src.getmembers():
            data = src.extractfile(info).read()  # type: ignore[union-attr]
            new = change(info.name, data)
            if new is None:
                continue
            info.size = len(new)
            out.addfile(info, io.BytesIO(new))
    return dest


def test_a_damaged_or_altered_archive_is_refused_and_nothing_is_written(
    tmp_path: Path, made: tuple[Server, Path]
) -> None:
    _srv, archive = made

    def flip_token(name: str, data: bytes) -> bytes:
        return data.replace(b"bcm_", b"bcx_") if name == "state/admin.token" else data

    def future_schema(name: str, data: bytes) -> bytes:
        if name != "manifest.json":
            return data
        m = json.loads(data)
        m["schema"] = ["9999_future"]
        return json.dumps(m).encode()

    def extra_member(name: str, data: bytes) -> bytes:
        if name != "manifest.json":
            return data
        m = json.loads(data)
        m["members"]["state/evil"] = {"sha256": "0" * 64, "size": 1, "mode": 0o600}
        return json.dumps(m).encode()

    def escaping(name: str, data: bytes) -> bytes:
        if name != "manifest.json":
            return data
        m = json.loads(data)
        m["members"]["state/../../etc/x"] = m["members"].pop("state/admin.token")
        return json.dumps(m).encode()

    cases = [
        (
            rewrite(archive, tmp_path / "t1.tar.gz", flip_token),
            "state/admin.token does not match its checksum",
        ),
        (
            rewrite(archive, tmp_path / "t2.tar.gz", future_schema),
            "schema 9999_future is newer than this bcm",
        ),
        (rewrite(archive, tmp_path / "t3.tar.gz", extra_member), "state/evil of its manifest is missing"),
        (rewrite(archive, tmp_path / "t4.tar.gz", escaping), "does not match a bcm backup's"),
        (
            rewrite(archive, tmp_path / "t5.tar.gz", lambda n, d: None if n == "state/admin.token" else d),
            "state/admin.token of its manifest is missing",
        ),
    ]
    truncated = tmp_path / "t6.tar.gz"
    truncated.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    cases.append((truncated, "truncated or not a bcm backup"))
    not_ours = tmp_path / "t7.tar.gz"
    with tarfile.open(not_ours, "w:gz") as tar:
        tar.add(__file__, arcname="README")
    cases.append((not_ours, "is not a bcm backup"))
    for bad, words in cases:
        refused(restore(tmp_path, bad), words)
        state = tmp_path / "b" / "state"
        assert not state.exists() or not any(state.iterdir()), bad
    assert restore(tmp_path, archive).returncode == 0  # the original is fine


def test_a_non_empty_target_or_the_other_database_kind_is_refused(
    tmp_path: Path, made: tuple[Server, Path]
) -> None:
    srv, archive = made
    target = tmp_path / "b" / "state"
    target.mkdir(parents=True)
    (target / "note").write_text("something an admin left")
    refused(restore(tmp_path, archive), "is not empty; restore into an empty one (--force overwrites)")
    assert sorted(p.name for p in target.iterdir()) == ["note"]
    # a database with tables, outside the state directory: refused, even into an empty state directory
    (target / "note").unlink()
    used = f"sqlite:///{srv.state_dir / 'bcm.db'}"
    refused(
        restore(tmp_path, archive, BCM_DATABASE_URL=used),
        "already holds tables; restore into an empty database",
    )
    assert not target.exists() or not any(target.iterdir())
    # a SQLite backup into PostgreSQL: not supported, said so
    refused(restore(tmp_path, archive, BCM_DATABASE_URL=PG_URL), "restoring across kinds is not supported")
    # --force restores over a non-empty state directory
    (target / "note").parent.mkdir(parents=True, exist_ok=True)
    (target / "note").write_text("x")
    assert restore(tmp_path, archive, "--force").returncode == 0
    assert (target / "admin.token").read_text() == (srv.state_dir / "admin.token").read_text()


def test_backup_refuses_a_wrong_state_and_keeps_an_existing_archive(
    tmp_path: Path, made: tuple[Server, Path]
) -> None:
    srv, archive = made
    before = archive.read_bytes()
    refused(srv.cli("backup", str(archive)), "exists; --force replaces it")
    assert archive.read_bytes() == before
    nowhere = Server(tmp_path / "nowhere")
    refused(nowhere.cli("backup", str(tmp_path / "x.tar.gz")), "no state directory at")
    inside = srv.cli("backup", str(srv.state_dir / "b.tar.gz"))
    refused(inside, "is inside the state directory")
    never = Server(tmp_path / "never")
    never.state_dir.mkdir()
    (never.state_dir / "bcm.db").touch()
    refused(never.cli("backup", str(tmp_path / "x.tar.gz")), "has bcm serve ever started on it?")
    down = never.cli(
        "backup",
        str(tmp_path / "x.tar.gz"),
        BCM_DATABASE_URL=f"postgresql+psycopg://bcm:{DB_PASSWORD}@127.0.0.1:1/bcm",
    )
    refused(down, "in the database postgresql+psycopg://bcm:***@127.0.0.1:1/bcm: connection failed")
    assert DB_PASSWORD not in down.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if "x.tar" in p.name or p.name.startswith(".")) == []
    assert srv.cli("backup", str(archive), "--force").returncode == 0


def test_images_and_settings_come_back_with_images_and_env_file(
    tmp_path: Path, made: tuple[Server, Path]
) -> None:
    srv, _ = made
    publish_image(f"sqlite:///{srv.state_dir / 'bcm.db'}", srv.state_dir / "images")
    env = tmp_path / "bcm.env"
    env.write_text("BCM_HOST=0.0.0.0\n")
    archive = tmp_path / "with-images.tar.gz"
    done = srv.cli("backup", str(archive), "--images", "--env-file", str(env))
    assert done.returncode == 0, done.stderr
    assert "1 image version(s) with their files" in done.stdout
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {
        "images/img/1/vmlinuz",
        "images/img/1/initramfs.img",
        "images/img/1/rootfs.squashfs",
        "settings/bcm.env",
    } <= names

    target = tmp_path / "b" / "state"
    restored = restore(tmp_path, archive)
    assert restored.returncode == 0, restored.stderr
    assert "images by reference" not in restored.stderr and "settings: wrote" in restored.stderr
    for f in ("vmlinuz", "initramfs.img", "rootfs.squashfs"):
        assert (target / "images/img/1" / f).read_bytes() == (srv.state_dir / "images/img/1" / f).read_bytes()
    assert (tmp_path / "b.env").read_text() == "BCM_HOST=0.0.0.0\n"
    assert stat.S_IMODE((tmp_path / "b.env").stat().st_mode) == 0o600
    # an admin's settings file that differs is kept; the backup's goes beside it
    shutil.rmtree(target)
    (tmp_path / "b.env").write_text("BCM_HOST=198.18.0.1\n")
    restored = restore(tmp_path, archive)
    assert restored.returncode == 0, restored.stderr
    assert (tmp_path / "b.env").read_text() == "BCM_HOST=198.18.0.1\n"
    assert (tmp_path / "b.env.restored").read_text() == "BCM_HOST=0.0.0.0\n"


def test_secrets_only_gives_a_second_head_the_state_directory_alone(
    tmp_path: Path, made: tuple[Server, Path]
) -> None:
    srv, archive = made
    target = tmp_path / "b" / "state"
    # the database is the first head's, in use (and of another kind than the backup's: nothing goes there)
    done = restore(tmp_path, archive, "--secrets-only", BCM_DATABASE_URL=PG_URL)
    assert done.returncode == 0, done.stderr
    assert "database not restored (--secrets-only)" in done.stdout
    for f in ("admin.token", "ssh/id_ed25519", "ssh/id_ed25519.pub"):
        assert (target / f).read_bytes() == (srv.state_dir / f).read_bytes()
    assert not (target / "bcm.db").exists() and not any(
        p.name.startswith(".restore-") for p in target.iterdir()
    )
    assert stat.S_IMODE((target / "ssh/id_ed25519").stat().st_mode) == 0o600


def test_a_backup_while_bcm_serve_writes_is_one_consistent_snapshot(tmp_path: Path) -> None:
    """Nodes are added one after another while the backup runs: the copy holds every node added before it
    started and, of the later ones, an unbroken run from the first (a snapshot, not a torn file)."""
    import threading

    srv = Server(tmp_path / "a" / "state", extra_env=dict(QUIET))
    srv.start()
    added: list[int] = []
    stop = threading.Event()

    def add_nodes() -> None:
        with api(srv) as c:
            i = 0
            while not stop.is_set() and i < 2000:
                i += 1
                ok(c.post("/api/v1/nodes", json={"name": f"w{i:04d}"}), 201)
                added.append(i)

    writer = threading.Thread(target=add_nodes)
    writer.start()
    try:
        while len(added) < 20:
            time.sleep(0.05)
        before = len(added)
        done = srv.cli("backup", str(tmp_path / "live.tar.gz"))
        assert done.returncode == 0, done.stderr
    finally:
        stop.set()
        writer.join(60)
        srv.stop()
    assert restore(tmp_path, tmp_path / "live.tar.gz").returncode == 0
    conn = sqlite3.connect(tmp_path / "b" / "state" / "bcm.db")
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        names = sorted(r[0] for r in conn.execute("SELECT name FROM node WHERE name LIKE 'w%'"))
    finally:
        conn.close()
    assert names == [f"w{i:04d}" for i in range(1, len(names) + 1)]
    assert before <= len(names) <= len(added)


def test_an_older_schema_is_restored_and_bcm_serve_upgrades_it(tmp_path: Path) -> None:
    """A backup made by an earlier bcm (its database at an earlier revision) restores; the next start migrates."""
    from alembic import command
    from alembic.script import ScriptDirectory

    from bcm.db import alembic_config

    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    head = script.get_current_head()
    older = script.get_revision(head).down_revision  # type: ignore[union-attr]
    assert isinstance(older, str)
    old = Server(tmp_path / "a" / "state")
    old.state_dir.mkdir(parents=True)
    db_url = f"sqlite:///{old.state_dir / 'bcm.db'}"
    command.upgrade(alembic_config(db_url), older)
    done = old.cli("backup", str(tmp_path / "older.tar.gz"))
    assert done.returncode == 0, done.stderr
    assert f"schema {older}," in done.stdout
    assert restore(tmp_path, tmp_path / "older.tar.gz").returncode == 0
    new = Server(tmp_path / "b" / "state")
    new.start()
    try:
        assert ok(api(new).get("/api/v1/nodes"))["total"] == 0
    finally:
        new.stop()
    engine = create_engine(f"sqlite:///{new.state_dir / 'bcm.db'}")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == head
    engine.dispose()


def test_restore_refuses_while_bcm_serve_runs_on_the_target(
    tmp_path: Path, made: tuple[Server, Path]
) -> None:
    _srv, archive = made
    running = Server(tmp_path / "b" / "state")
    running.start()
    try:
        refused(restore(tmp_path, archive, "--force"), "stop it before restoring")
    finally:
        running.stop()
