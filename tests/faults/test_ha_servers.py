"""Several real `bcm serve` processes: one SQLite server per database file; on PostgreSQL exactly one
leader, `GET /api/v1/ha` and `bcm ha status`, and kill -9 of the leader → the other leads with a higher
epoch. Loopback only; every wait is bounded; no timing thresholds (bench/ha.py measures the times)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from bcm.devserver import BCM, REPO, Server
from tests.conftest import pg_schema

LEASE_S = 3.0  # short, yet long enough for a loaded 2-core machine to renew in time
WAIT_S = 60.0  # bound on any wait below (many leases)


def ha(server: Server, token: str) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/api/v1/ha", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    """Poll ``check`` until it returns something true; bounded."""
    deadline = time.monotonic() + timeout_s
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
    raise AssertionError(f"{what}: not within {timeout_s} s (last: {last!r})")


# PXE on loopback only (proxy DHCP, no router adverts): the leader's dnsmasq is a process to look for
PXE_ON_LO = {
    "BCM_PXE__ENABLED": "true",
    "BCM_PXE__INTERFACE": "lo",
    "BCM_PXE__ADDRESS": "127.0.0.1",
    "BCM_PXE__MODE": "proxy",
    "BCM_PXE__IPV6_RA": "false",
}


def live_dnsmasq(server: Server) -> list[int]:
    """dnsmasq processes running (not stopped, not dead) with this server's config."""
    mark = f"--conf-file={server.state_dir / 'pxe' / 'dnsmasq.conf'}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if mark in argv and os.path.basename(argv[0]) == b"dnsmasq" and state not in ("T", "t", "Z", "X"):
            found.append(int(pid))
    return found


@pytest.fixture(params=[False, True], ids=["plain", "pxe"])
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Server, Server, str]]:
    """Two servers on one PostgreSQL schema, a short lease; the token of the first serves both. With
    ``pxe`` (root: dnsmasq binds the DHCP port) both are configured to serve PXE on loopback."""
    if request.param and (os.geteuid() != 0 or not shutil.which("dnsmasq")):
        pytest.skip("dnsmasq on loopback needs root and dnsmasq")
    with pg_schema() as url:
        env = {
            "BCM_HA__LEASE_S": str(LEASE_S),
            "BCM_LOG_LEVEL": "info",
            **(PXE_ON_LO if request.param else {}),
        }
        a = Server(tmp_path / "a", database_url=url, extra_env=env)
        b = Server(tmp_path / "b", database_url=url, extra_env=env)
        try:
            a.start()  # inside: a start that timed out leaves a process to stop too
            b.start()
            yield a, b, a.token()
        finally:
            for s in (a, b):  # a SIGSTOPped process is woken first, so that it stops on SIGTERM
                if s.proc is not None and s.proc.poll() is None:
                    s.proc.send_signal(signal.SIGCONT)
            b.stop()
            a.stop()


def one_leader(a: Server, b: Server, token: str) -> tuple[Server, Server, dict[str, Any]]:
    """Both servers alive and agreeing on one leader; returns (leader, follower, the leader's view)."""

    def agreed() -> tuple[Server, Server, dict[str, Any]] | None:
        va, vb = ha(a, token), ha(b, token)
        if not va["leader"]["holder"] or va["leader"] != vb["leader"]:
            return None
        if len([s for s in va["servers"] if s["alive"]]) != 2:
            return None
        if va["this_server"]["leading"] == vb["this_server"]["leading"]:
            return None  # exactly one of the two says it leads
        return (a, b, va) if va["this_server"]["leading"] else (b, a, vb)

    found: tuple[Server, Server, dict[str, Any]] = wait_for("one leader agreed by both", agreed)
    lead, view = found[0], found[2]
    assert view["leader"]["holder"] == view["this_server"]["id"]
    assert view["leader"]["address"] and str(lead.port) in view["leader"]["address"]
    return found


def test_a_second_server_on_one_sqlite_file_is_refused(tmp_path: Path) -> None:
    first = Server(tmp_path / "state")
    try:
        first.start()
        second = Server(tmp_path / "state")  # same state dir, so the same bcm.db; another port
        proc = subprocess.run(
            [*BCM, "serve"], env=second.env(), cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 1
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert lines[-1].startswith("error: another bcm serve (pid "), proc.stderr[-2000:]
        assert "SQLite keeps one server" in lines[-1] and "Traceback" not in proc.stderr
        assert httpx.get(f"{first.url}/readyz", timeout=10).status_code == 200  # the first one carries on
        first.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        first.proc.wait(10)  # type: ignore[union-attr]
        second.start()  # the kernel dropped the dead one's lock: a restart is not refused
        second.stop()
    finally:
        first.stop()


def test_one_leader_status_and_kill_9_takeover_with_a_higher_epoch(pair: tuple[Server, Server, str]) -> None:
    a, b, token = pair
    lead, follower, view = one_leader(a, b, token)
    epoch = view["leader"]["epoch"]
    assert epoch >= 1
    ids = {s["id"] for s in view["servers"]}
    assert len(ids) == 2 and all(s["version"] for s in view["servers"])

    cli = follower.cli("ha", "status", "--json", BCM_TOKEN=token)
    assert cli.returncode == 0, cli.stderr
    import json

    assert json.loads(cli.stdout)["leader"]["holder"] == view["leader"]["holder"]
    table = follower.cli("ha", "status", BCM_TOKEN=token)
    assert table.returncode == 0, table.stderr
    assert f"epoch {epoch}" in table.stdout and view["leader"]["holder"] in table.stdout

    viewer = httpx.post(
        f"{lead.url}/api/v1/tokens",
        json={"name": "ha-viewer", "role": "viewer"},
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    assert viewer.status_code == 201, viewer.text
    assert ha(follower, viewer.json()["token"])["leader"]["epoch"] == epoch  # a viewer may read it
    assert httpx.get(f"{follower.url}/api/v1/ha", timeout=10).status_code == 401

    old_holder = view["leader"]["holder"]
    assert lead.proc is not None
    os.kill(lead.proc.pid, signal.SIGKILL)
    lead.proc.wait(10)

    def taken_over() -> dict[str, Any] | None:
        v = ha(follower, token)
        return v if v["leader"]["holder"] == v["this_server"]["id"] and v["this_server"]["leading"] else None

    after = wait_for("the survivor takes the lease", taken_over)
    if "BCM_PXE__ENABLED" in a.extra_env:  # the dead leader's dnsmasq went with it; the survivor's runs
        wait_for(
            "dnsmasq on the survivor only",
            lambda: not live_dnsmasq(lead) and len(live_dnsmasq(follower)) == 1,
        )
    assert after["leader"]["holder"] != old_holder
    assert after["leader"]["epoch"] > epoch
    dead = next(s for s in after["servers"] if s["id"] == old_holder)
    # the takeover came only after the dead leader's last heartbeat had gone silent (database clock)
    assert after["leader"]["acquired_at"] > dead["heartbeat_at"]


def test_a_frozen_leader_is_replaced_fenced_and_never_runs_dnsmasq_beside_the_new_one(
    pair: tuple[Server, Server, str],
) -> None:
    """SIGSTOP the leader for three leases, then SIGCONT: the other leads with a higher epoch; the old one
    steps down and its write as the old epoch is refused; at no moment do two dnsmasq run (with PXE)."""
    a, b, token = pair
    pxe = "BCM_PXE__ENABLED" in a.extra_env
    lead, follower, view = one_leader(a, b, token)
    old_id, epoch = view["leader"]["holder"], view["leader"]["epoch"]
    if pxe:
        wait_for(
            "the leader's dnsmasq runs", lambda: len(live_dnsmasq(lead)) == 1 and not live_dnsmasq(follower)
        )
    samples = 0

    def at_most_one_dnsmasq() -> None:
        nonlocal samples
        if pxe:
            running = live_dnsmasq(lead) + live_dnsmasq(follower)
            assert len(running) <= 1, f"two dnsmasq at once: {running}"
            samples += 1

    assert lead.proc is not None
    lead.proc.send_signal(signal.SIGSTOP)
    frozen_at = time.monotonic()

    def replaced() -> dict[str, Any] | None:
        at_most_one_dnsmasq()
        v = ha(follower, token)
        taken = v["this_server"]["leading"] and v["leader"]["holder"] == v["this_server"]["id"]
        serving = not pxe or len(live_dnsmasq(follower)) == 1
        return v if taken and serving and time.monotonic() - frozen_at >= 3 * LEASE_S else None

    after = wait_for("the follower leads while the old leader is frozen for three leases", replaced)
    new_id, new_epoch = after["leader"]["holder"], after["leader"]["epoch"]
    assert new_id != old_id and new_epoch > epoch
    assert not pxe or live_dnsmasq(lead) == []  # the frozen leader's dnsmasq was stopped by its leash

    lead.proc.send_signal(signal.SIGCONT)

    def stepped_down() -> dict[str, Any] | None:
        at_most_one_dnsmasq()
        v = ha(lead, token)
        me = v["this_server"]
        return v if not me["leading"] and me["refused_writes"] >= 1 and v["leader"]["epoch"] > epoch else None

    woke = wait_for("the old leader steps down after SIGCONT", stepped_down)
    assert woke["this_server"]["epoch"] is None and woke["leader"]["epoch"] >= new_epoch
    for _ in range(int(2 * LEASE_S / 0.1)):  # two more leases: never two dnsmasq
        at_most_one_dnsmasq()
        time.sleep(0.1)
    final = ha(follower, token)
    assert (
        final["leader"]["epoch"] >= new_epoch
    )  # (a loaded machine may move the lease again: epochs only grow)
    assert not pxe or samples > 0

    events = httpx.get(
        f"{follower.url}/api/v1/events",
        params={"limit": 1000},
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    ).json()
    ha_events = [
        (e["action"], e["target"], (e.get("detail") or {}).get("epoch"), e["time"])
        for e in events
        if e["action"].startswith("ha.")
    ]
    assert ("ha.leader", new_id, new_epoch) in [e[:3] for e in ha_events]  # the takeover is in the audit log
    # after SIGCONT the old leader recorded its step-down as epoch ``epoch``: refused, so nothing it wrote as
    # that epoch is dated after the takeover (on a loaded machine it may have stepped down and back before)
    taken = datetime.fromisoformat(after["leader"]["acquired_at"])
    late = [
        e for e in ha_events if e[1] == old_id and e[2] == epoch and datetime.fromisoformat(e[3]) >= taken
    ]
    assert late == [], ha_events
