"""Two head namespaces with real keepalived and real `bcm serve` on one PostgreSQL (#27 items 3, 5):
the service address sits on the head whose bcm leads; kill -9 of that bcm moves the address to the other
head, which answers there as the new leader with a higher epoch; a frozen head (bcm and keepalived
SIGSTOPped for three leases) loses the lease, and after SIGCONT the address ends on the leader only.
Lab addresses in namespaces made here (198.18.229.0/24); a PostgreSQL cluster of its own reached by
socket. Root only; every wait bounded."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bcm.devserver import free_port
from bcm.lab.heads import Heads

pytestmark = pytest.mark.lab
LEASE_S = 2.0
WAIT_S = 90.0
HBA = "local all all trust\nhost all all 127.0.0.1/32 trust\n"


def _run(*argv: str) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"{' '.join(argv)}: {proc.stderr[-1500:]}"
    return proc.stdout


@pytest.fixture
def socket_db() -> Iterator[str]:
    """A PostgreSQL cluster of its own, trusted on its socket (which every namespace sees)."""
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("pg_createcluster", "keepalived", "curl", "ip")):
        pytest.skip("needs root, pg_createcluster, keepalived, curl and ip")
    name, port = f"bcmheads{uuid.uuid4().hex[:6]}", free_port()
    _run("pg_createcluster", "15", name, "-p", str(port), "--start-conf", "manual")
    try:
        Path(f"/etc/postgresql/15/{name}/pg_hba.conf").write_text(HBA)
        _run("pg_ctlcluster", "--skip-systemctl-redirect", "15", name, "start")
        for sql in ("CREATE ROLE bcm LOGIN SUPERUSER", "CREATE DATABASE bcm OWNER bcm"):
            _run("runuser", "-u", "postgres", "--", "psql", "-h", "/var/run/postgresql", "-p", str(port), "-c", sql)
        yield f"postgresql+psycopg://bcm@/bcm?host=/var/run/postgresql&port={port}"
    finally:
        subprocess.run(["pg_dropcluster", "--stop", "15", name], capture_output=True, timeout=120, check=False)


def wait_for(what: str, check: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + WAIT_S
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (httpx.HTTPError, AssertionError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {WAIT_S} s (last: {last!r})")


def test_the_service_address_follows_the_leader(tmp_path: Path, socket_db: str) -> None:
    heads = Heads(tmp_path / "heads", 2, socket_db, name=f"bh{uuid.uuid4().hex[:4]}", lease_s=LEASE_S)
    try:
        heads.up()
        auth = {"Authorization": f"Bearer {heads.token()}"}

        def at_vip() -> dict[str, Any]:
            r = httpx.get(f"{heads.url}/api/v1/ha", headers=auth, timeout=2)
            assert r.status_code == 200, r.text
            return dict(r.json())

        def vip_on_leader() -> tuple[int, dict[str, Any]] | None:
            holders = heads.holders()
            v = at_vip()
            me = v["this_server"]
            if len(holders) != 1 or not me["leading"] or v["leader"]["holder"] != me["id"]:
                return None
            assert me["address"].startswith(heads.head(holders[0]).address + ":")  # the holder answered
            return holders[0], v

        first, view = wait_for("the address on the leading head", vip_on_leader)
        epoch = view["leader"]["epoch"]

        heads.kill(first)
        second, after = wait_for("the address on the other head, now leading", lambda: (
            (found := vip_on_leader()) and found[0] != first and found))  # fmt: skip
        assert after["leader"]["epoch"] > epoch and after["leader"]["holder"] != view["leader"]["holder"]
        assert heads.holders() == [second]

        # a frozen leading head: the other takes the lease; once thawed, the address ends on the leader only
        heads._start_serve(heads.head(first))  # the killed head's bcm again (a new server id)
        heads.freeze(second)
        frozen_at = time.monotonic()


        def restarted_leads() -> dict[str, Any] | None:
            r = httpx.get(f"{heads.head(first).url}/api/v1/ha", headers=auth, timeout=2)
            v = dict(r.json())
            ok = v["this_server"]["leading"] and first in heads.holders()  # the frozen head keeps it too (LAB.md)
            return v if ok and time.monotonic() - frozen_at >= 3 * LEASE_S else None

        during = wait_for("the restarted head leads while the other is frozen", restarted_leads)
        heads.thaw(second)
        final = wait_for("after SIGCONT the address is on the leader only", lambda: (
            (found := vip_on_leader()) and found[0] == first
            and found[1]["leader"]["epoch"] == during["leader"]["epoch"] and found))  # fmt: skip
        assert final[1]["leader"]["epoch"] > after["leader"]["epoch"]
        r = httpx.get(f"http://{heads.head(second).address}:8470/leaderz", timeout=2)
        assert r.status_code == 503  # the old leader knows it is not
    finally:
        heads.down()
