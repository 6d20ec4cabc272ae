"""``bcm-agent``: the node-side GPU health agent (stdlib only; pynvml is loaded when NVML is used).

    bcm-agent                       run: report every interval and at once on an Xid event
    bcm-agent --once                collect one report, print it as JSON, send nothing
    bcm-agent --fake FIXTURE.json   answer from a recorded fixture instead of the real NVML

Exit status: 0 done, 2 bad configuration, 3 NVML unusable (``--once`` only; the daemon keeps reporting
the failure so the server sees it), 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import signal
import ssl
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

import bcm
from bcm.agent import schema
from bcm.agent.collector import KmsgReader, XidWatcher, collect, utc_iso
from bcm.agent.nvml import NvmlBackend, NvmlError, RealNvml
from bcm.agent.reporter import (
    DEFAULT_CONFIG_PATH,
    AgentConfig,
    ConfigError,
    Reporter,
    SendError,
    opener_for,
    post_json,
)

log = logging.getLogger("bcm.agent")

# How often the loop wakes to poll the kernel log and retry buffered reports while waiting.
POLL_S = 1.0


def open_backend(fake: str | None) -> NvmlBackend:
    """The fake from a fixture file, a lab node's simulated GPUs, or the machine's real NVML."""
    from bcm.agent.fake_nvml import SIMULATED_NVML_PATH, FakeNvml, SimulatedNvml

    if fake:
        return FakeNvml.from_file(fake, blocking=True)
    if Path(SIMULATED_NVML_PATH).exists():  # only `bcm lab up --gpus N` writes it
        log.warning("simulated GPUs: replaying recorded NVML values from %s", SIMULATED_NVML_PATH)
        return SimulatedNvml(SIMULATED_NVML_PATH)
    return RealNvml()


def failure_report(error: str, expected_gpus: int | None, hostname: str | None = None) -> schema.Report:
    """The report sent when NVML cannot start: no GPUs, and why."""
    import socket

    return {
        "schema": schema.SCHEMA_VERSION,
        "agent_version": bcm.__version__,
        "hostname": (hostname or socket.gethostname())[: schema.MAX_STRING],
        "collected_at": utc_iso(time.time()),
        "driver_version": None,
        "cuda_driver_version": None,
        "gpu_count": 0,
        "expected_gpu_count": expected_gpus,
        "gpus": [],
        "xid_events": [],
        "errors": [error[: schema.MAX_STRING]],
    }


class Agent:
    """The reporting loop: a report every ``interval_s`` and one at once when an Xid arrives."""

    def __init__(
        self,
        config: AgentConfig,
        backend: NvmlBackend,
        reporter: Reporter,
        *,
        watcher: XidWatcher | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        hostname: str | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.reporter = reporter
        self.watcher = watcher or XidWatcher(backend, kmsg=KmsgReader(), use_kmsg=config.kmsg)
        self.hostname = hostname
        self.stop_event = threading.Event()
        self.nvml_ready = False
        self._mono = monotonic

    def _ensure_nvml(self) -> str | None:
        if self.nvml_ready:
            return None
        try:
            self.backend.init()
        except NvmlError as exc:
            return f"NVML init failed: {exc}"
        self.nvml_ready = True
        self.watcher.start()
        for problem in self.watcher.problems:
            log.warning("%s", problem)
        return None

    def report_once(self, events: list[schema.XidEvent]) -> schema.Report:
        """Collect (or describe why not) and hand the report to the reporter."""
        error = self._ensure_nvml()
        if error is not None:
            report = failure_report(error, self.config.expected_gpus, self.hostname)
        else:
            report = collect(
                self.backend, self.config.expected_gpus, xid_events=events, hostname=self.hostname
            )
        self.reporter.submit(report)
        return report

    def run(self, max_reports: int | None = None) -> int:
        """Report until stopped (or ``max_reports`` reports); returns how many were made."""
        made = 0
        next_at = self._mono()
        while not self.stop_event.is_set() and (max_reports is None or made < max_reports):
            events: list[schema.XidEvent] = []
            if self.nvml_ready:
                events = self.watcher.wait(max(0.0, min(POLL_S, next_at - self._mono())))
            elif self._mono() < next_at:
                self.stop_event.wait(max(0.0, min(POLL_S, next_at - self._mono())))
            if events or self._mono() >= next_at:
                if events:
                    log.warning("Xid %s: reporting now", ", ".join(str(e["xid"]) for e in events))
                self.report_once(events)
                made += 1
                next_at = self._mono() + self.config.interval_s
            else:
                self.reporter.flush()
        return made

    def close(self) -> None:
        self.watcher.stop()
        if self.nvml_ready:
            with contextlib.suppress(NvmlError):
                self.backend.shutdown()
            self.nvml_ready = False


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bcm-agent", description="bcm node agent: GPU health reports to the head node."
    )
    parser.add_argument("--config", default=DEFAULT_CONFIG_PATH, help="JSON config, mode 0600 (%(default)s)")
    parser.add_argument("--once", action="store_true", help="collect one report, print it, send nothing")
    parser.add_argument(
        "--expected-gpus", type=int, default=None, help="with --once: GPUs this node should have"
    )
    parser.add_argument(
        "--fake", metavar="FIXTURE", help="use a recorded NVML fixture instead of the real NVML"
    )
    parser.add_argument("--verbose", "-v", action="store_true")
    parser.add_argument("--version", action="version", version=f"bcm-agent {bcm.__version__}")
    return parser


FACTS_TRIES = 3
FACTS_RETRY_S = 10.0


def push_facts(
    config: AgentConfig,
    *,
    collect_facts: Callable[[], str] | None = None,
    send: Callable[[str, str, bytes, float], int] = post_json,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Send this machine's hardware facts (the fact script's output, as an SSH inventory gets it) once, a
    few tries at most; False when they did not arrive (the server's SSH inventory still can)."""
    from bcm.agent.facts import collect_local

    text = (collect_facts or collect_local)()
    body = json.dumps({"output": text}).encode()
    for attempt in range(1, FACTS_TRIES + 1):
        try:
            send(config.server_url + "/boot/v1/agent/facts", config.token, body, max(config.timeout_s, 30.0))
            log.info("facts sent (%d bytes)", len(text))
            return True
        except SendError as exc:
            log.warning("facts not sent (attempt %d of %d): %s", attempt, FACTS_TRIES, exc)
            if not exc.retryable:
                return False
        if attempt < FACTS_TRIES:
            sleep(FACTS_RETRY_S)
    return False


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s bcm-agent %(levelname)s %(message)s",
    )
    try:
        backend = open_backend(args.fake)
    except NvmlError as exc:
        print(f"bcm-agent: NVML unavailable: {exc}", file=sys.stderr)
        return 3
    if args.once:
        try:
            backend.init()
        except NvmlError as exc:
            print(f"bcm-agent: NVML init failed: {exc}", file=sys.stderr)
            return 3
        try:
            print(json.dumps(collect(backend, args.expected_gpus), indent=2))
        finally:
            backend.shutdown()
        return 0
    try:
        config = AgentConfig.load(args.config)
    except ConfigError as exc:
        print(f"bcm-agent: {exc}", file=sys.stderr)
        return 2
    try:
        opener = opener_for(config.ca_file)
    except (OSError, ssl.SSLError) as exc:
        print(f"bcm-agent: cannot read ca_file {config.ca_file}: {exc}", file=sys.stderr)
        return 2
    send = functools.partial(post_json, opener=opener)
    if config.push_facts:
        push_facts(config, send=send)
    reporter = Reporter(
        config.server_url, config.token, buffer_max=config.buffer_max, timeout_s=config.timeout_s, send=send
    )
    agent = Agent(config, backend, reporter)

    def _stop(signum: int, frame: FrameType | None) -> None:
        agent.stop_event.set()

    signal.signal(signal.SIGTERM, _stop)
    try:
        agent.run()
    except KeyboardInterrupt:
        return 130
    finally:
        agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
