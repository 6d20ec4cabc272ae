"""200 concurrent clients spread over 3 real `bcm serve` on one PostgreSQL database (#27, 6c).

PATCHes, node verbs applied at once (drain, resume), verbs that start operations (inventory over SSH,
power status over Redfish), reads and health reports, all at once, round robin over the three servers.
Asserted: no 5xx at all; every change of a node's state the database saw is one step of the transition
table (a trigger records each one, whichever server wrote it); every operation ends in a terminal state;
no node stays locked; `/healthz` answered on every server throughout. Its latency is printed, never
asserted (no timing thresholds in tests: ``bench/concurrency.py`` and ``bench/ha.py`` measure).

The nodes' SSH and BMC addresses are loopback ports where nothing listens, so every operation fails its
nodes at once and quickly; the legality of what that does to them is part of what is checked.
"""

from __future__ import annotations

import random
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from bcm.devserver import Server, free_port
from bcm.domain.states import TRANSITIONS, State
from bcm.models.operation import OpState
from tests.api.test_health_api import REPORT_URL, report
from tests.conftest import pg_schema
from tests.faults.conftest import client, hammer

SERVERS = 3
CLIENTS = 200
REQUESTS = 1200  # bounded: a fixed list, CLIENTS at a time
NODES = [f"hc{i:02d}" for i in range(1, 13)]
OP_NODES = NODES[:6]  # inventory and power only here: the others stay in service for drain/resume
WAIT_S = 120.0  # bound on waiting for the operations to end
PROBE_EVERY_S = 0.1

# every (from, to) one verb or internal event may make; "from == to" is no change and never recorded
LEGAL = {(s.value, to.value) for (s, _), to in TRANSITIONS.items() if s is not to}

SHARED = ("secret.key", "ssh/id_ed25519", "ssh/id_ed25519.pub", "admin.token")  # the README's list


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[tuple[list[Server], str]]:
    """Three servers on one PostgreSQL schema; the second and third get the first's secrets copied
    before their first start, as the README says to add a head node."""
    closed = free_port()  # nothing listens here: SSH and BMC calls are refused at once
    with pg_schema() as url:
        env = {"BCM_SSH__PORT": str(closed), "BCM_HA__LEASE_S": "3", "BCM_LOG_LEVEL": "info"}
        servers = [Server(tmp_path / f"s{i}", database_url=url, extra_env=env) for i in range(SERVERS)]
        try:
            servers[0].start()
            for other in servers[1:]:
                for name in SHARED:
                    if (servers[0].state_dir / name).exists():
                        (other.state_dir / name).parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(servers[0].state_dir / name, other.state_dir / name)
                other.start()
            yield servers, url
        finally:
            for s in servers:
                s.stop()


def _prepare(first: Server, bmc_port: int) -> dict[str, str]:
    """The nodes, in service (ready: the way there is verbs through an inventory that needs a real SSH
    node, so they are put there behind the server's back, as tests/faults/conftest.make_nodes does), with
    an SSH address and a BMC; returns each node's agent token."""
    with client(first) as c:
        r = c.post("/api/v1/categories", json={"name": "hc", "bmc_protocol": "redfish", "bmc_user": "admin"})
        assert r.status_code == 201, r.text
        assert c.put("/api/v1/categories/hc/bmc-allow-http", json={"allow": True}).status_code == 200
        r = c.post("/api/v1/nodes/bulk", json={"nodes": "hc[01-12]", "category": "hc", "ip": "127.0.0.21"})
        assert r.status_code == 201, r.text
        for name in NODES:
            got = c.patch(f"/api/v1/nodes/{name}", json={"bmc_address": f"http://127.0.0.1:{bmc_port}"})
            assert got.status_code == 200, got.text
        got = c.put("/api/v1/nodes/bmc-password", json={"nodes": "hc[01-12]", "password": "Pw-for-bmc-27"})
        assert got.status_code == 200, got.text
        return {n: c.post(f"/api/v1/nodes/{n}/token").json()["token"] for n in NODES}


class Prober:
    """GET /healthz on one server every PROBE_EVERY_S until stopped (bounded by ``limit_s``)."""

    def __init__(self, server: Server, limit_s: float) -> None:
        self.server, self.limit_s = server, limit_s
        self.answers: list[tuple[int, float]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + self.limit_s
        # A new connection per probe, as a load balancer's or keepalived's check makes: with a kept-alive
        # one, a prober thread starved of the GIL by the 200 clients for uvicorn's keep-alive time (5 s)
        # sends on a connection the server has just closed and reads "Server disconnected" -- a race
        # of the client's connection reuse, not an answer of the server.
        while not self.stop.is_set() and time.monotonic() < deadline:
            t0 = time.monotonic()
            try:
                status = httpx.get(f"{self.server.url}/healthz", timeout=30).status_code
            except httpx.HTTPError as exc:
                status = 599
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self.answers.append((status, time.monotonic() - t0))
            self.stop.wait(PROBE_EVERY_S)

    def figures(self) -> str:
        times = sorted(t for _, t in self.answers)
        if not times:
            return "no answers"
        p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
        return (
            f"{len(times)} probes, p50 {statistics.median(times) * 1000:.0f} ms, "
            f"p99 {p99 * 1000:.0f} ms, max {times[-1] * 1000:.0f} ms"
        )


def test_200_clients_over_3_servers_get_no_5xx_and_move_nodes_only_legally(
    trio: tuple[list[Server], str],
) -> None:
    servers, url = trio
    bmc_port = free_port()
    tokens = _prepare(servers[0], bmc_port)
    engine = create_engine(url)
    try:
        with engine.begin() as conn:  # in service, behind the servers' backs (see _prepare)
            conn.execute(text("UPDATE node SET provision_state = 'ready' WHERE name LIKE 'hc%'"))
            # from here on every change of state is recorded, whichever server makes it
            conn.execute(text("CREATE TABLE moves (node text, old text, new text, at timestamptz)"))
            conn.execute(
                text(
                    "CREATE FUNCTION note_move() RETURNS trigger AS $$ BEGIN "
                    "INSERT INTO moves VALUES (NEW.name, OLD.provision_state, NEW.provision_state, clock_timestamp()); "
                    "RETURN NEW; END $$ LANGUAGE plpgsql"
                )
            )
            conn.execute(
                text(
                    "CREATE TRIGGER note_move AFTER UPDATE OF provision_state ON node FOR EACH ROW "
                    "WHEN (OLD.provision_state IS DISTINCT FROM NEW.provision_state) EXECUTE FUNCTION note_move()"
                )
            )

        reports = {n: report(n) for n in NODES}
        rng = random.Random(627)
        Send = Callable[[httpx.Client], httpx.Response]

        def pick(nodes: list[str]) -> str:
            return rng.choice(nodes)

        def patch(n: str) -> Send:
            comment = f"c{rng.random():.6f}"
            return lambda c: c.patch(f"/api/v1/nodes/{n}", json={"comment": comment})

        def verb(path: str, n: str) -> Send:
            return lambda c: c.post(path, json={"nodes": n})

        def health(n: str) -> Send:
            return lambda c: c.post(
                REPORT_URL, json=reports[n], headers={"Authorization": f"Bearer {tokens[n]}"}
            )

        def get(path: str) -> Send:
            return lambda c: c.get(path)

        makers: list[Callable[[], Send]] = [
            *[lambda: patch(pick(NODES))] * 4,
            lambda: verb("/api/v1/nodes/actions/drain", pick(NODES)),
            lambda: verb("/api/v1/nodes/actions/resume", pick(NODES)),
            lambda: verb("/api/v1/nodes/actions/inventory", pick(OP_NODES)),
            lambda: verb("/api/v1/nodes/actions/power-status", pick(OP_NODES)),
            lambda: health(pick(NODES)),
            lambda: health(pick(NODES)),
            lambda: get(f"/api/v1/nodes/{pick(NODES)}"),
            lambda: get("/api/v1/nodes?limit=50"),
            lambda: get("/api/v1/operations?limit=20"),
            lambda: get("/healthz"),
        ]
        requests = [makers[i % len(makers)]() for i in range(REQUESTS)]

        probers = [Prober(s, limit_s=600) for s in servers]
        for p in probers:
            p.thread.start()
        try:
            answers = hammer(servers, CLIENTS, requests)

            def all_ended() -> list[tuple[int, str]]:
                with engine.connect() as conn:
                    return [
                        tuple(r)
                        for r in conn.execute(
                            text("SELECT id, state FROM operation WHERE state IN ('pending', 'running')")
                        )
                    ]

            deadline = time.monotonic() + WAIT_S
            open_ops = all_ended()
            while open_ops and time.monotonic() < deadline:
                time.sleep(0.5)
                open_ops = all_ended()
        finally:
            for p in probers:
                p.stop.set()
                p.thread.join(40)

        for s, p in zip(servers, probers, strict=True):
            print(f"/healthz on {s.url} during the run: {p.figures()}")
        statuses = answers.statuses
        print(
            f"{len(statuses)} requests over {SERVERS} servers, {CLIENTS} at a time: "
            + ", ".join(f"{k}: {statuses.count(k)}" for k in sorted(set(statuses)))
        )

        assert not answers.server_errors(), answers.server_errors()[:5]
        assert set(statuses) <= {200, 201, 202, 409}, sorted(set(statuses))
        assert statuses.count(202) >= 1  # health reports were stored among the writers
        for s, p in zip(servers, probers, strict=True):  # every server answered its probes, every time
            assert p.answers and all(st == 200 for st, _ in p.answers), (
                s.url,
                [a for a in p.answers if a[0] != 200][:5],
                p.errors[:5],
            )

        assert open_ops == [], f"operations still open after {WAIT_S} s: {open_ops}"
        with engine.connect() as conn:
            ops = [tuple(r) for r in conn.execute(text("SELECT id, kind, state, owner FROM operation"))]
            moves = [tuple(r) for r in conn.execute(text("SELECT node, old, new FROM moves ORDER BY at"))]
            locked = [
                tuple(r)
                for r in conn.execute(
                    text(
                        "SELECT name, lock_owner FROM node WHERE lock_owner IS NOT NULL OR lock_expires IS NOT NULL"
                    )
                )
            ]
            final = dict(tuple(r) for r in conn.execute(text("SELECT name, provision_state FROM node")))
            power = [
                tuple(r)
                for r in conn.execute(text("SELECT id, results FROM operation WHERE kind = 'power-status'"))
            ]
        # each server read the BMC password with the key copied from the first: every power status reached
        # for the BMC (and was refused), none stopped at a key it could not decrypt with
        why = {r["status"] for _, results in power for r in (results or {}).values()}
        assert why == {"unreachable"}, [p for p in power if p[1] and "unreachable" not in str(p[1])][:3]
        kinds = {k for _, k, _, _ in ops}
        assert {"inventory", "power-status"} <= kinds, kinds  # operations were started among the rest
        assert all(OpState(st).finished for _, _, st, _ in ops), ops
        assert all(owner is None for *_, owner in ops), ops  # no lease left on an ended operation
        assert locked == [], locked
        illegal = [m for m in moves if (m[1], m[2]) not in LEGAL]
        assert illegal == [], illegal
        assert moves, "no node changed state: the run tested nothing"
        # each node's recorded moves chain: every move starts where the previous one ended
        for name in NODES:
            mine = [(o, n) for node, o, n in moves if node == name]
            for (_, to), (frm, _) in zip(mine, mine[1:], strict=False):
                assert frm == to, (name, mine)
            assert not mine or mine[-1][1] == final[name], (name, mine, final[name])
        assert set(final.values()) <= {s.value for s in State}
    finally:
        engine.dispose()
