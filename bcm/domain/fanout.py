"""The pure rules of a fan-out to many nodes: which failures to retry, how long to wait, how many at once.

No I/O and no clock of its own: the driver (:mod:`bcm.drivers.ssh`) passes the time (``now``) and a
random generator in, so tests drive both.

- :func:`is_transient`: a failure before the command started that the head's own load can cause
  (connect timeout, reset, refused, no route, banner timeout) is worth another attempt; a definite
  one (authentication refused, host key changed, command failed or timed out once running) never is.
- :class:`RetryPolicy`: a bounded number of attempts, exponential backoff with jitter, and never a
  retry that could not finish its connect before the operation's deadline.
- :class:`AimdLimit`: how many hosts may be in flight. It starts at the configured fan-out (the
  ceiling), halves when connects time out or come close to the timeout (once per window: only a
  connect that began after the last cut can cut again), and grows back by ``increase`` per ``limit``
  fast connects. A fan-out set too high then costs time, not hosts.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

# Per-host statuses (bcm.drivers.ssh.HostStatus values) that a retry may cure, if the command never ran.
TRANSIENT_STATUSES = frozenset({"unreachable", "timed_out"})


def is_transient(status: str, command_started: bool) -> bool:
    """Whether a failed attempt may be retried: only connect-stage failures, never once the command ran."""
    return status in TRANSIENT_STATUSES and not command_started


@dataclass(frozen=True)
class RetryPolicy:
    """At most ``attempts`` tries per host; the wait before try n+1 is in [d/2, d], d = base·2^(n-1) ≤ cap."""

    attempts: int = 4
    backoff_s: float = 0.5
    backoff_cap_s: float = 8.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        """The wait after failed try ``attempt`` (1-based): equal jitter, so retries spread but never bunch at 0."""
        full = min(self.backoff_cap_s, self.backoff_s * 2 ** (attempt - 1))
        return full / 2 + rng.random() * full / 2

    def next_delay(
        self,
        attempt: int,
        transient: bool,
        now: float,
        deadline: float,
        connect_s: float,
        rng: random.Random,
    ) -> float | None:
        """The wait before the next try, or None: definite failure, attempts used up, or no time left."""
        if not transient or attempt >= self.attempts:
            return None
        wait = self.delay(attempt, rng)
        if now + wait + connect_s > deadline:
            return None
        return wait


def fan_out_budget(hosts: int, ceiling: int, connect_s: float, command_s: float) -> float:
    """Seconds a fan-out may take: each batch of ``ceiling`` hosts a connect and a command timeout.

    The same bound the work engine gives an SSH operation (less its margin), so retries end in time.
    """
    batches = max(1, math.ceil(hosts / max(1, ceiling)))
    return batches * (connect_s + command_s)


@dataclass
class AimdLimit:
    """Additive increase, multiplicative decrease of the number of hosts in flight.

    ``on_connect(started, latency_s)`` after a connect that succeeded; ``on_congestion(started)`` after
    one that timed out or was dropped during the handshake. A connect slower than ``slow_s`` counts as
    congestion: it was close to failing. Only a connect that started after the last decrease may
    decrease again, so one overloaded window cuts once, not once per host in it.
    """

    ceiling: int
    slow_s: float
    floor: int = 1
    decrease: float = 0.5
    increase: float = 1.0  # hosts added per window of ``limit`` fast connects
    value: float = field(init=False)
    last_cut: float = field(init=False, default=-math.inf)
    cuts: int = field(init=False, default=0)
    lowest: int = field(init=False)

    def __post_init__(self) -> None:
        self.ceiling = max(1, self.ceiling)
        self.floor = max(1, min(self.floor, self.ceiling))
        self.value = float(self.ceiling)
        self.lowest = self.ceiling

    @property
    def limit(self) -> int:
        return int(self.value)

    def on_connect(self, started: float, latency_s: float, now: float) -> None:
        if latency_s > self.slow_s:
            self.on_congestion(started, now)
        else:
            self.value = min(float(self.ceiling), self.value + self.increase / self.value)

    def on_congestion(self, started: float, now: float) -> None:
        if started < self.last_cut:
            return  # began under the old limit: already answered for
        self.value = max(float(self.floor), self.value * self.decrease)
        self.last_cut = now
        self.cuts += 1
        self.lowest = min(self.lowest, self.limit)
