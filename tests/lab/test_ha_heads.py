"""Two head namespaces with real keepalived and real `bcm serve` on one PostgreSQL (#27 items 3, 5), driven
through the CLI an admin uses for the drill: `bcm lab up --heads 2 --database-url …` leaves the heads running
after it exits; the service address sits on the head whose bcm leads; `bcm lab head kill` of that head moves
the address to the other, which answers there (`bcm ha status` through the address) as the new leader with a
higher epoch; after `bcm lab head start`, a frozen head (`bcm lab head freeze`, three leases long) loses the
lease, and after `bcm lab head thaw` the address ends on the leader only; `bcm lab down` leaves no process,
namespace or veth. Lab addresses in namespaces made there (198.18.229.0/24); a PostgreSQL cluster of its own
reached by socket. Root only; every wait bounded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bcm.lab import net, procs
from bcm.lab.heads import socket_cluster
from tests.faults.test_ha_servers import wait_for as shared_wait_for

pytestmark = pytest.mark.lab
LEASE_S = 2.0  # bcm.lab.heads' lease
WAIT_S = 90.0
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def socket_db() -> Iterator[str]:
    """A PostgreSQL cluster of its own, trusted on its socket (which every namespace sees)."""
    if os.geteuid() != 0 or not all(
        shutil.which(t) for t in ("pg_createcluster", "keepalived", "curl", "ip")
    ):
        pytest.skip("needs root, pg_createcluster, keepalived, curl and ip")
    with socket_cluster() as url:
        yield url


def bcm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI as an admin runs it, in a process of its own (what it starts must outlive it)."""
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def ok(*args: str, env: dict[str, str] | None = None) -> str:
    proc = bcm(*args, env=env)
    assert proc.returncode == 0, f"bcm {' '.join(args)}: {proc.stdout[-1500:]}{proc.stderr[-1500:]}"
    return proc.stdout


def ours(work: Path) -> list[int]:
    """Live processes that name the heads' directory (keepalived's config, bcm serve's BCM_STATE_DIR)."""
    found = []
    for pid in procs.all_pids():
        try:
            text = Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if str(work).encode() in text and procs.start_time(pid) is not None and pid != os.getpid():
            found.append(pid)
    return found


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    return shared_wait_for(what, check, timeout_s)


def test_the_service_address_follows_the_leader(tmp_path: Path, socket_db: str) -> None:
    name = f"bh{uuid.uuid4().hex[:4]}"
    where = ["--state-dir", str(tmp_path / "lab"), "--name", name]
    work = tmp_path / "lab" / "heads"
    try:
        shown = ok("lab", "up", "--heads", "2", "--database-url", socket_db, *where)
        assert "service address http://198.18.229.1:8470, leader: head " in shown
        status = json.loads(ok("lab", "head", "status", "--json", *where))
        assert [(h["head"], h["serve"], h["keepalived"]) for h in status["heads"]] == [
            (1, "up", "up"),
            (2, "up", "up"),
        ]
        vip, urls = status["service_url"], {h["head"]: h["url"] for h in status["heads"]}
        pids = [p for h in status["heads"] for p in (h["serve_pid"], h["keepalived_pid"])]
        assert vip == "http://198.18.229.1:8470" and all(procs.start_time(p) is not None for p in pids)
        token = Path(status["token_file"]).read_text().strip()
        auth = {"Authorization": f"Bearer {token}"}

        def holders() -> list[int]:
            listed = json.loads(ok("lab", "head", "status", "--json", *where))["heads"]
            return [h["head"] for h in listed if h["service_address"]]

        def at_vip() -> dict[str, Any]:
            r = httpx.get(f"{vip}/api/v1/ha", headers=auth, timeout=2)
            assert r.status_code == 200, r.text
            return dict(r.json())

        def vip_on_leader() -> tuple[int, dict[str, Any]] | None:
            held = holders()
            v = at_vip()
            me = v["this_server"]
            if len(held) != 1 or not me["leading"] or v["leader"]["holder"] != me["id"]:
                return None
            assert urls[held[0]].endswith(me["address"])  # the holder answered
            return held[0], v

        first, view = wait_for("the address on the leading head", vip_on_leader)
        epoch = view["leader"]["epoch"]

        assert f"head {first}: bcm serve killed" in ok("lab", "head", "kill", str(first), *where)
        second, after = wait_for(
            "the address on the other head, now leading",
            lambda: (found := vip_on_leader()) and found[0] != first and found,
        )
        assert after["leader"]["epoch"] > epoch and after["leader"]["holder"] != view["leader"]["holder"]
        assert holders() == [second]
        ha = json.loads(ok("ha", "status", "--json", env={"BCM_URL": vip, "BCM_TOKEN": token}))
        assert ha["leader"]["holder"] == after["leader"]["holder"] and ha["this_server"]["leading"]

        # a frozen leading head: the other takes the lease; once thawed, the address ends on the leader only
        ok("lab", "head", "start", str(first), *where)  # the killed head's bcm again (a new server id)
        ok("lab", "head", "freeze", str(second), *where)
        frozen_at = time.monotonic()
        assert {
            h["head"]: h["serve"] for h in json.loads(ok("lab", "head", "status", "--json", *where))["heads"]
        } == {first: "up", second: "frozen"}

        def restarted_leads() -> dict[str, Any] | None:
            r = httpx.get(f"{urls[first]}/api/v1/ha", headers=auth, timeout=2)
            v = dict(r.json())
            leads = (
                v["this_server"]["leading"] and first in holders()
            )  # the frozen head keeps it too (LAB.md)
            return v if leads and time.monotonic() - frozen_at >= 3 * LEASE_S else None

        during = wait_for("the restarted head leads while the other is frozen", restarted_leads)
        ok("lab", "head", "thaw", str(second), *where)
        final = wait_for(
            "after SIGCONT the address is on the leader only",
            lambda: (
                (found := vip_on_leader())
                and found[0] == first
                and found[1]["leader"]["epoch"] == during["leader"]["epoch"]
                and found
            ),
        )
        assert final[1]["leader"]["epoch"] > after["leader"]["epoch"]
        r = httpx.get(f"{urls[second]}/leaderz", timeout=2)
        assert r.status_code == 503  # the old leader knows it is not
        assert ours(work), "bcm serve and keepalived run detached, beyond the command that started them"
    finally:
        down = bcm("lab", "down", *where)
    assert down.returncode == 0, down.stderr[-1500:]
    assert procs.wait_gone(ours(work), 5) == [], "a head's process outlived bcm lab down"
    left = [ns for ns in net.netns_names() if ns.startswith(f"{name}ha-")]
    assert left == [] and not net.link_exists(f"{name}ha-h")
    assert bcm("lab", "head", "status", *where).returncode == 1  # nothing recorded any more
