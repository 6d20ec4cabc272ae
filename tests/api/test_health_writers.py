"""Health ingest in writer processes (health.ingest_processes > 0) against the real database: a writer
process that dies costs its batch a 503, not the next reports. (The answers themselves are tested in both
modes in tests/api/test_health_batch.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import Any

from sqlalchemy.engine import Engine

from bcm.errors import Unavailable
from bcm.models.health import HealthRecord
from bcm.workers.ingest import IngestQueue
from tests.api.test_health_api import add_nodes, node_token, report
from tests.api.test_health_batch import rows


def in_processes(settings: Any, n: int) -> Any:
    return settings.model_copy(update={"health": settings.health.model_copy(update={"ingest_processes": n})})


def body(rep: dict[str, Any]) -> bytes:
    return json.dumps(rep).encode()


def test_a_dead_writer_process_costs_one_503_then_a_new_one_writes(
    api: Any, engine: Engine, settings: Any
) -> None:
    add_nodes(api, engine, "gpu01")
    tok = node_token(api, "gpu01")
    queue = IngestQueue(engine, in_processes(settings, 1))

    async def go() -> tuple[Any, Any, Any]:
        try:
            first = await queue.submit(tok, body(report("gpu01")))
            assert queue._pool is not None
            for pid in list(queue._pool._processes):  # type: ignore[attr-defined]
                os.kill(pid, signal.SIGKILL)
            for _ in range(50):  # the pool notices its process is gone (bounded: 5 s)
                if queue._pool._broken:  # type: ignore[attr-defined]
                    break
                await asyncio.sleep(0.1)
            lost: Any = None
            try:
                await queue.submit(tok, body(report("gpu01")))
            except Unavailable as exc:
                lost = exc
            again = await queue.submit(tok, body(report("gpu01")))
            return first, lost, again
        finally:
            await queue.stop()

    first, lost, again = asyncio.run(go())
    assert first.node == "gpu01" and again.node == "gpu01"
    assert isinstance(lost, Unavailable) and lost.status_code == 503 and lost.retry_after >= 1
    assert rows(engine, HealthRecord, "gpu01") == 2  # the refused report is not stored
