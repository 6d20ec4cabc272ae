"""The dnsmasq leash (bcm.workers.leader.Leash): a watchdog process that kills this server's dnsmasq when
the leader's beat goes stale (PostgreSQL: another server may lead by now), and never for a late beat on
SQLite, where no other server can lead (a loaded machine must not lose DHCP), only when the server is gone.

A stand-in dnsmasq: a Python process whose argv[0] is ``dnsmasq`` and which carries the server's
``--conf-file=``, which is all the leash looks at."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bcm.settings import Settings
from bcm.workers.leader import Leash


def fake_dnsmasq(conf: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["dnsmasq", "-c", "import time; time.sleep(120)", f"--conf-file={conf}"],
        executable=sys.executable,
    )


def dead_within(proc: subprocess.Popen[bytes], seconds: float) -> bool:
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


@pytest.mark.parametrize(("limit_s", "killed"), [(0.5, True), (float("inf"), False)], ids=["pg", "sqlite"])
def test_a_stale_beat_stops_dnsmasq_only_where_another_server_could_lead(
    tmp_path: Path, limit_s: float, killed: bool
) -> None:
    settings = Settings(state_dir=tmp_path)
    leash = Leash(settings, limit_s)
    leash.conf.parent.mkdir(parents=True, exist_ok=True)
    dnsmasq = fake_dnsmasq(leash.conf)
    try:
        leash.start(time.time() - 3600)  # the last good round an hour ago: stale for any finite limit
        assert dead_within(dnsmasq, 10) is killed
        assert leash.running  # the leash itself goes on while its server lives
    finally:
        leash.stop()
        dnsmasq.kill()
        dnsmasq.wait()


def test_the_leash_stops_dnsmasq_when_its_server_is_gone_even_on_sqlite(tmp_path: Path) -> None:
    """A server killed with its dnsmasq still running: the leash (limit infinite) kills dnsmasq and exits."""
    conf = tmp_path / "pxe" / "dnsmasq.conf"
    conf.parent.mkdir(parents=True)
    dnsmasq = fake_dnsmasq(conf)
    script = (
        "import sys, time; from pathlib import Path; from bcm.settings import Settings; "
        "from bcm.workers.leader import Leash; "
        f"l = Leash(Settings(state_dir=Path({str(tmp_path)!r})), float('inf')); l.start(time.time()); "
        "print(l.proc.pid, flush=True)"
    )
    server = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    leash_pid = int(server.stdout.split()[0])
    try:
        assert dead_within(dnsmasq, 10), "dnsmasq outlived its server"
        for _ in range(100):  # bounded: 10 s
            if (
                not Path(f"/proc/{leash_pid}").exists()
                or " Z " in Path(f"/proc/{leash_pid}/stat").read_text()
            ):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the leash outlived its server")
    finally:
        dnsmasq.kill()
        dnsmasq.wait()
        if Path(f"/proc/{leash_pid}").exists():
            os.kill(leash_pid, 9)


@pytest.mark.parametrize(
    ("url", "finite"),
    [("sqlite:///{state}/bcm.db", False), ("postgresql+psycopg://bcm@/bcm?host=/nonexistent", True)],
    ids=["sqlite", "postgresql"],
)
def test_the_leader_leashes_dnsmasq_to_its_lease_only_on_postgresql(
    tmp_path: Path, url: str, finite: bool
) -> None:
    from types import SimpleNamespace

    from sqlalchemy import create_engine

    from bcm.workers.leader import LOCAL_MARGIN, Leadership

    settings = Settings(state_dir=tmp_path)
    engine = create_engine(url.format(state=tmp_path))  # not connected: only its dialect is read
    try:
        leadership = Leadership(SimpleNamespace(state=SimpleNamespace(engine=engine, settings=settings)))
        expected = settings.ha.lease_s * LOCAL_MARGIN if finite else float("inf")
        assert leadership.leash.limit_s == expected
    finally:
        engine.dispose()
