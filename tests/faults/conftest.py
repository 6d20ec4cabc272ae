"""Fault tests: a real `bcm serve` process on loopback, on SQLite or PostgreSQL, driven over HTTP."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import bindparam, create_engine, text

from bcm.devserver import Server
from tests.conftest import pg_schema


@dataclass
class Answers:
    """What a batch of concurrent requests got back: (status, seconds) per request."""

    got: list[tuple[int, float, str]] = field(default_factory=list)

    @property
    def statuses(self) -> list[int]:
        return [s for s, _, _ in self.got]

    @property
    def slowest(self) -> float:
        return max((t for _, t, _ in self.got), default=0.0)

    def server_errors(self) -> list[tuple[int, float, str]]:
        return [g for g in self.got if g[0] >= 500]


def client(server: Server, timeout: float = 60) -> httpx.Client:
    return httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {server.token()}"}, timeout=timeout
    )


def hammer(
    server: Server | Sequence[Server], workers: int, requests: list[Callable[[httpx.Client], httpx.Response]]
) -> Answers:
    """Send every request, ``workers`` at a time, each on its own connection; bounded by the list. Given
    several servers, the requests go round robin over them (request i to server i mod n)."""
    answers = Answers()
    servers = [server] if isinstance(server, Server) else list(server)

    def one(i: int, send: Callable[[httpx.Client], httpx.Response]) -> tuple[int, float, str]:
        with client(servers[i % len(servers)]) as c:
            t0 = time.monotonic()
            try:
                r = send(c)
            except httpx.HTTPError as exc:  # a reset or a timeout counts as a server failure
                try:
                    where = f" ({exc.request.method} {exc.request.url.path})"
                except RuntimeError:  # no request attached
                    where = ""
                return 599, time.monotonic() - t0, f"{type(exc).__name__}: {exc}{where}"
            return r.status_code, time.monotonic() - t0, r.text[:300]

    with ThreadPoolExecutor(workers) as pool:
        answers.got = list(pool.map(one, range(len(requests)), requests))
    return answers


@pytest.fixture(params=["sqlite", "postgresql"])
def backend_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    if request.param == "sqlite":
        yield None
        return
    with pg_schema() as url:
        yield url


@pytest.fixture
def server(tmp_path: Path, backend_url: str | None) -> Iterator[Server]:
    srv = Server(tmp_path / "state", database_url=backend_url)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def make_nodes(server: Server, hostlist: str, state: str | None = None, **body: Any) -> None:
    """Register nodes over HTTP; put them in ``state`` behind the server's back (no verb leads there)."""
    with client(server) as c:
        r = c.post("/api/v1/nodes/bulk", json={"nodes": hostlist, **body})
        assert r.status_code == 201, r.text
    if state:
        engine = create_engine(server.database_url or f"sqlite:///{server.state_dir / 'bcm.db'}")
        with engine.begin() as conn:
            conn.execute(
                text("UPDATE node SET provision_state = :s WHERE name IN :names").bindparams(
                    bindparam("names", expanding=True)
                ),
                {"s": state, "names": [n["name"] for n in r.json()]},
            )
        engine.dispose()


def states(server: Server, hostlist: str) -> dict[str, str]:
    with client(server) as c:
        r = c.get("/api/v1/nodes", params={"nodes": hostlist, "limit": 1000})
        assert r.status_code == 200, r.text
        return {n["name"]: n["provision_state"] for n in r.json()["items"]}
