"""The write-behind ingest queue (bcm.workers.ingest) against the real database (SQLite and PostgreSQL):
reports that arrive together are written in one transaction, yet each gets its own answer; a node's two
reports in one batch are judged in order; a full queue refuses with 503 + Retry-After; stopping writes
what was taken and refuses the rest."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.engine import Engine
from sqlmodel import Session

from bcm.domain.health_report import HealthReport
from bcm.errors import BcmError, Forbidden, InvalidInput, Unauthorized, Unavailable
from bcm.models.health import GpuHealth, HealthRecord, NodeHealth
from bcm.workers.ingest import IngestQueue
from tests.api.test_health_api import add_nodes, node_token, report, with_xid


def parsed(body: dict[str, Any]) -> HealthReport:
    return HealthReport.model_validate(body)


def raw(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def rows(engine: Engine, model: Any, node: str) -> int:
    with Session(engine) as s:
        node_id = s.execute(text("SELECT id FROM node WHERE name = :n"), {"n": node}).scalar_one()
        return int(
            s.execute(select(func.count()).select_from(model).where(model.node_id == node_id)).scalar_one()
        )


async def submit_all(queue: IngestQueue, items: list[tuple[str, Any]]) -> list[Any]:
    return await asyncio.gather(*(queue.submit(t, r) for t, r in items), return_exceptions=True)


@pytest.mark.parametrize("processes", [0, 2], ids=["thread", "processes"])
def test_reports_arriving_together_are_one_batch_with_their_own_answers(
    api: Any, engine: Engine, settings: Any, processes: int
) -> None:
    """The raw bodies the route hands over, written in the server's thread or in writer processes
    (health.ingest_processes): the same answers either way."""
    add_nodes(api, engine, "gpu[01-05]")
    tok = {n: node_token(api, n) for n in ("gpu01", "gpu02", "gpu03", "gpu04", "gpu05")}
    health = settings.health.model_copy(update={"ingest_processes": processes})
    queue = IngestQueue(engine, settings.model_copy(update={"health": health}))

    async def go() -> list[Any]:
        try:
            return await submit_all(
                queue,
                [
                    (tok["gpu01"], raw(report("gpu01"))),
                    (tok["gpu02"], raw(with_xid(report("gpu02")))),
                    ("bcm_not-a-token", b"{not json"),  # unknown token: a 401 even for a malformed body
                    (tok["gpu03"], raw(report("gpu04"))),  # a node reporting as another
                    (tok["gpu04"], b'{"schema": 1}'),
                    (
                        tok["gpu05"],
                        InvalidInput("gpus.0.index: invalid", field="gpus.0.index"),
                    ),  # refused before
                ],
            )
        finally:
            await queue.stop()

    ok, fail, unknown, foreign, invalid, refused = asyncio.run(go())
    assert queue.batches == 1 and queue.reports == 6  # one transaction for all of them
    assert (ok.node, ok.verdict, ok.action) == ("gpu01", "OK", None)
    assert (fail.node, fail.verdict, fail.action) == ("gpu02", "FAIL", "drain")
    assert isinstance(unknown, Unauthorized)
    assert isinstance(foreign, Forbidden) and "gpu04" in foreign.message
    assert isinstance(invalid, InvalidInput) and invalid.field, invalid
    assert isinstance(refused, InvalidInput) and refused.field == "gpus.0.index"
    # what was accepted is stored, nothing of what was refused
    assert (
        rows(engine, HealthRecord, "gpu01") == 1 and rows(engine, HealthRecord, "gpu02") == 1
    )  # one per report
    assert rows(engine, HealthRecord, "gpu03") == 0 and rows(engine, HealthRecord, "gpu04") == 0
    assert api.get("/api/v1/health").json()["failing"] == ["gpu02"]


def test_a_nodes_two_reports_in_one_batch_are_judged_in_order(
    api: Any, engine: Engine, settings: Any
) -> None:
    add_nodes(api, engine, "gpu01")
    tok = node_token(api, "gpu01")
    gpus = len(report("gpu01")["gpus"])
    queue = IngestQueue(engine, settings)

    async def go() -> list[Any]:
        try:
            return await submit_all(
                queue, [(tok, parsed(with_xid(report("gpu01")))), (tok, parsed(report("gpu01")))]
            )
        finally:
            await queue.stop()

    first, second = asyncio.run(go())
    assert queue.batches == 1
    assert (first.verdict, first.report_verdict, first.action) == ("FAIL", "FAIL", "drain")
    # the second met the state the first left: a FAIL holds until enough healthy reports in a row
    assert (second.verdict, second.report_verdict, second.action) == ("FAIL", "OK", None)
    assert rows(engine, GpuHealth, "gpu01") == gpus  # one latest row per GPU (upserted once per statement)
    assert rows(engine, HealthRecord, "gpu01") == 2
    with Session(engine) as s:
        nh = s.execute(select(NodeHealth.consecutive_ok, NodeHealth.pending_action)).one()
    assert tuple(nh) == (1, "drain")


def test_a_full_queue_refuses_with_retry_after_and_keeps_what_it_took(
    api: Any, engine: Engine, settings: Any
) -> None:
    add_nodes(api, engine, "gpu[01-02]")
    t1, t2 = node_token(api, "gpu01"), node_token(api, "gpu02")
    queue = IngestQueue(
        engine, settings.model_copy(update={"health": settings.health.model_copy(update={"ingest_queue": 1})})
    )

    async def go() -> list[Any]:
        try:
            return await submit_all(queue, [(t1, parsed(report("gpu01"))), (t2, parsed(report("gpu02")))])
        finally:
            await queue.stop()

    taken, refused = asyncio.run(go())
    assert taken.node == "gpu01"
    assert isinstance(refused, Unavailable) and refused.status_code == 503 and refused.retry_after >= 1
    assert "waiting" in refused.message
    assert rows(engine, HealthRecord, "gpu02") == 0
    assert (queue.refused, queue.reports) == (1, 1)  # /metrics: bcm_health_ingest_refused_total


def test_stopping_writes_the_waiting_reports_and_refuses_new_ones(
    api: Any, engine: Engine, settings: Any
) -> None:
    add_nodes(api, engine, "gpu[01-03]")
    tok = {n: node_token(api, n) for n in ("gpu01", "gpu02", "gpu03")}
    queue = IngestQueue(engine, settings)

    async def go() -> tuple[list[Any], BaseException | None]:
        waiting = [asyncio.ensure_future(queue.submit(tok[n], parsed(report(n)))) for n in ("gpu01", "gpu02")]
        await asyncio.sleep(0)  # both are queued
        await queue.stop()
        late: BaseException | None = None
        try:
            await queue.submit(tok["gpu03"], parsed(report("gpu03")))
        except BcmError as exc:
            late = exc
        return [w.result() for w in waiting], late

    done, late = asyncio.run(go())
    assert [r.node for r in done] == ["gpu01", "gpu02"]
    assert isinstance(late, Unavailable)
    assert rows(engine, HealthRecord, "gpu03") == 0


@pytest.mark.parametrize("agents", [1, 30])
def test_over_http_every_report_is_answered_after_it_is_stored(api: Any, engine: Engine, agents: int) -> None:
    """Many agents at once through the real app: each 202 names its own node, and every one is stored."""
    import concurrent.futures

    names = [f"gpu{i:02d}" for i in range(1, agents + 1)]
    add_nodes(api, engine, f"gpu[01-{agents:02d}]")
    tok = {n: node_token(api, n) for n in names}
    bodies = {n: json.dumps(report(n)).encode() for n in names}

    def one(name: str) -> Any:
        return api.post(
            "/boot/v1/agent/report",
            content=bodies[name],
            headers={"Authorization": f"Bearer {tok[name]}", "Content-Type": "application/json"},
        )

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(agents, 16)) as pool:
        answers = dict(zip(names, pool.map(one, names), strict=True))
    assert {n: (r.status_code, r.json()["node"]) for n, r in answers.items()} == {n: (202, n) for n in names}
    assert all(rows(engine, HealthRecord, n) > 0 for n in names)


@pytest.mark.parametrize(("linger_ms", "batches"), [(2_000, 2), (0, 4)], ids=["lingering", "at-once"])
def test_while_a_batch_is_written_the_next_gathers_for_the_linger(
    api: Any, engine: Engine, settings: Any, linger_ms: float, batches: int
) -> None:
    """Writer processes (health.ingest_processes): reports that arrive while another batch is being written
    wait up to ingest_linger_ms and go as one batch (one transaction); with no linger each goes at once."""
    add_nodes(api, engine, "gpu[01-04]")
    tok = {n: node_token(api, n) for n in ("gpu01", "gpu02", "gpu03", "gpu04")}
    health = settings.health.model_copy(update={"ingest_processes": 2, "ingest_linger_ms": linger_ms})
    queue = IngestQueue(engine, settings.model_copy(update={"health": health}))

    async def go() -> list[Any]:
        try:
            first = asyncio.ensure_future(queue.submit(tok["gpu01"], raw(report("gpu01"))))
            while not queue._writing:  # the first batch is with a writer (the process is still starting)
                await asyncio.sleep(0.001)
            later = []
            for name in ("gpu02", "gpu03", "gpu04"):
                later.append(asyncio.ensure_future(queue.submit(tok[name], raw(report(name)))))
                await asyncio.sleep(0.05)  # a flusher with no linger has started this one alone meanwhile
            if linger_ms:  # the three gather behind the first, which the writer is still on
                assert len(queue._writing) == 1 and queue.waiting == 3
            return await asyncio.gather(first, *later)
        finally:
            await queue.stop()

    answers = asyncio.run(go())
    assert [a.node for a in answers] == ["gpu01", "gpu02", "gpu03", "gpu04"]
    assert (queue.batches, queue.reports) == (batches, 4)
