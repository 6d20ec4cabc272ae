"""What a long verb is to the work engine: a :class:`Handler` (how to run it) and a :class:`Job` (one run).

Handlers are listed in one table (:mod:`bcm.workers.verbs`); the runner (:mod:`bcm.workers.runner`)
only creates, claims, runs, renews and closes operations. Workers import this module, never the
runner, so no import cycle runs through it.

Contract of a handler's ``run``: it works on ``job.names`` (on a reclaim, the nodes that have no
result yet), records per-node results through :mod:`bcm.services.operations` (``add_results``;
``start`` and ``finish`` too if it likes: the runner finishes what it leaves open) and may raise:
a :class:`~bcm.errors.BcmError` fails the operation with its message. Every write it makes to its
operation is fenced: once the operation has ended (a cancel) or another server holds it, the write
raises :class:`~bcm.services.operations.LeaseLost` and nothing of that transaction is kept.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy.engine import Engine
from sqlmodel import Session

from bcm.models.operation import Operation
from bcm.settings import Settings


def fan_out_timeout(settings: Settings, n: int) -> float:
    """SSH fan-out: every batch of ``concurrency`` hosts may take a connect and a command timeout."""
    batches = max(1, math.ceil(n / settings.ssh.concurrency))
    return batches * (settings.ssh.connect_timeout_s + settings.ssh.command_timeout_s) + 60.0


@dataclass(frozen=True)
class Job:
    """One run of an operation, on the server that holds its lease."""

    engine: Engine
    settings: Settings
    op_id: int
    names: list[str]  # the nodes to work on now: on a reclaim, those without a result yet
    actor: str
    spec: dict[str, Any] = field(default_factory=dict)
    claims: int = 1  # 1: the first run; more: taken up again after its server went away


# setup(session, op, extra) -> the nodes to lock (None: those given), in the transaction that creates
# the operation; raising there creates nothing (a 404/409 for the caller). ``extra`` is what the caller
# handed over that must not be stored (a deploy request with its secrets).
Setup = Callable[[Session, Operation, Any], "list[str] | None"]
# on_error(session, op, settings, message): in the transaction that fails or cancels the operation
OnError = Callable[[Session, Operation, Settings, str], None]


@dataclass(frozen=True)
class Handler:
    run: Callable[[Job], Awaitable[None]]
    timeout: Callable[[Settings, int], float] = fan_out_timeout  # the whole operation, every claim
    setup: Setup | None = None
    on_error: OnError | None = None
    # its steps are idempotent: a reclaimed operation runs again for the nodes without a result
    # (else they fail with the reason)
    resumable: bool = True
    moves_state: bool = False  # a lifecycle verb: legality checked and target states set at start


class Starter(Protocol):
    """What starts operations (the runner), as workers see it."""

    engine: Engine
    settings: Settings

    async def submit(
        self,
        kind: str,
        names: list[str],
        actor: str,
        reason: str | None = None,
        *,
        spec: dict[str, Any] | None = None,
        extra: Any = None,
    ) -> int: ...
