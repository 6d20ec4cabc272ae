"""Send reports to the head node: stdlib HTTP, a bounded buffer while the server is away, the agent loop.

Reports are POSTed as JSON to ``{server_url}/boot/v1/agent/report`` with ``Authorization: Bearer
<node token>``; over https the server is verified against ``ca_file`` (bcm's CA, from the node's overlay or
the agent deploy), else the system's CAs. A report that cannot be delivered (connection refused, timeout, 5xx, 408, 429) stays in
a bounded buffer and is retried oldest first; when the buffer is full the oldest report is dropped. A
report the server refuses outright (other 4xx) is dropped at once: resending it would never succeed.
"""

from __future__ import annotations

import json
import logging
import ssl
import stat
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bcm.agent import schema

log = logging.getLogger("bcm.agent")

DEFAULT_CONFIG_PATH = "/etc/bcm/agent.json"
REPORT_PATH = "/boot/v1/agent/report"
_RETRYABLE_STATUS = frozenset({408, 429})
# Ignore http_proxy and friends: the head node is on the provisioning network, and a proxy meant for the
# internet must never see the node token.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def opener_for(ca_file: str | None) -> urllib.request.OpenerDirector:
    """No proxy; https verified (chain and host name) against ``ca_file``, or the system's CAs without one.
    Raises OSError or ssl.SSLError when the file cannot be read as certificates."""
    context = ssl.create_default_context(cafile=ca_file)
    return urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
    )


class ConfigError(Exception):
    """The agent's configuration file is missing, unsafe or malformed."""


@dataclass(frozen=True)
class AgentConfig:
    """The agent's settings, read from a JSON file only root may read."""

    server_url: str
    token: str = field(repr=False)
    interval_s: float = 30.0
    expected_gpus: int | None = None
    buffer_max: int = 120
    timeout_s: float = 10.0
    kmsg: bool | None = None  # None: read the kernel log only where NVML events are unavailable
    push_facts: bool = False  # at start, send this machine's hardware facts (a node bcm booted: no SSH round)
    ca_file: str | None = None  # the CA an https server_url is verified against (else the system's)

    @classmethod
    def load(cls, path: str | Path = DEFAULT_CONFIG_PATH) -> AgentConfig:
        """Read and check the file; refuse one that group or others can read (it holds the token)."""
        p = Path(path)
        try:
            st = p.stat()
        except OSError as exc:
            raise ConfigError(f"cannot read agent config {p}: {exc.strerror}") from exc
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise ConfigError(
                f"agent config {p} has mode {stat.S_IMODE(st.st_mode):04o}; it holds the node token, "
                f"so it must be readable by its owner only: chmod 600 {p}"
            )
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"agent config {p} is not valid JSON: {exc}") from exc
        return cls.from_dict(data, source=str(p))

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "config") -> AgentConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        known = {
            "server_url",
            "token",
            "interval_s",
            "expected_gpus",
            "buffer_max",
            "timeout_s",
            "kmsg",
            "push_facts",
            "ca_file",
        }
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown keys {unknown}; known: {sorted(known)}")
        for key in ("server_url", "token"):
            if not isinstance(data.get(key), str) or not data[key]:
                raise ConfigError(f"{source}: {key!r} must be a non-empty string")
        if not data["server_url"].startswith(("http://", "https://")):
            raise ConfigError(f"{source}: server_url must start with http:// or https://")
        if data.get("ca_file") is not None and (not isinstance(data["ca_file"], str) or not data["ca_file"]):
            raise ConfigError(f"{source}: 'ca_file' must be a non-empty string (a PEM file)")
        try:
            config = cls(
                server_url=data["server_url"].rstrip("/"),
                token=data["token"],
                interval_s=float(data.get("interval_s", 30.0)),
                expected_gpus=None if data.get("expected_gpus") is None else int(data["expected_gpus"]),
                buffer_max=int(data.get("buffer_max", 120)),
                timeout_s=float(data.get("timeout_s", 10.0)),
                kmsg=data.get("kmsg"),
                push_facts=data.get("push_facts", False) is True,
                ca_file=data.get("ca_file"),
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: {exc}") from exc
        if config.interval_s <= 0 or config.buffer_max < 1 or config.timeout_s <= 0:
            raise ConfigError(f"{source}: interval_s and timeout_s must be > 0 and buffer_max >= 1")
        return config


class SendError(Exception):
    """A report did not arrive; ``retryable`` says whether sending it again may succeed."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def post_json(
    url: str, token: str, body: bytes, timeout_s: float, opener: urllib.request.OpenerDirector = _OPENER
) -> int:
    """POST ``body`` and return the HTTP status; raises :class:`SendError` when it did not arrive."""
    request = urllib.request.Request(  # noqa: S310 - the scheme is checked when the config is loaded
        url,
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    try:
        with opener.open(request, timeout=timeout_s) as response:
            response.read(65_536)
            return int(response.status)
    except urllib.error.HTTPError as exc:
        retryable = exc.code >= 500 or exc.code in _RETRYABLE_STATUS
        raise SendError(f"server answered {exc.code} {exc.reason}", retryable=retryable) from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SendError(f"server unreachable: {reason}", retryable=True) from exc


class Reporter:
    """Delivers reports oldest first, keeping at most ``buffer_max`` undelivered ones."""

    def __init__(
        self,
        server_url: str,
        token: str,
        *,
        buffer_max: int = 120,
        timeout_s: float = 10.0,
        send: Callable[[str, str, bytes, float], int] = post_json,
        monotonic: Callable[[], float] = time.monotonic,
        backoff_max_s: float = 30.0,
    ) -> None:
        self.url = server_url.rstrip("/") + REPORT_PATH
        self._token = token
        self.buffer: deque[bytes] = deque(maxlen=buffer_max)
        self.timeout_s = timeout_s
        self.sent = 0
        self.dropped = 0
        self.rejected = 0
        self.last_error: str | None = None
        self._send = send
        self._mono = monotonic
        self._failures = 0
        self._retry_at = 0.0
        self._backoff_max = backoff_max_s

    def submit(self, report: schema.Report) -> int:
        """Queue a report and try to deliver everything queued; returns how many were delivered now."""
        body = json.dumps(report, separators=(",", ":")).encode()
        if len(body) > schema.MAX_REPORT_BYTES:
            self.rejected += 1
            self.last_error = f"report of {len(body)} bytes exceeds {schema.MAX_REPORT_BYTES}; not sent"
            log.error("%s", self.last_error)
            return self.flush()
        if len(self.buffer) == self.buffer.maxlen:
            self.dropped += 1
            log.warning("report buffer full (%d); dropping the oldest report", self.buffer.maxlen)
        self.buffer.append(body)
        return self.flush()

    def flush(self, *, force: bool = False) -> int:
        """Send queued reports oldest first until one fails; waits out the backoff unless ``force``."""
        if not force and self._mono() < self._retry_at:
            return 0
        delivered = 0
        while self.buffer:
            try:
                self._send(self.url, self._token, self.buffer[0], self.timeout_s)
            except SendError as exc:
                self.last_error = str(exc)
                if not exc.retryable:
                    self.buffer.popleft()
                    self.rejected += 1
                    log.error("server refused a report, dropping it: %s", exc)
                    continue
                self._failures += 1
                # 1, 2, 4 … seconds, capped: a dead server is not hammered by event-triggered reports.
                self._retry_at = self._mono() + min(self._backoff_max, 2.0 ** (self._failures - 1))
                log.warning("report not delivered (%d queued): %s", len(self.buffer), exc)
                break
            self.buffer.popleft()
            delivered += 1
            self.sent += 1
            self._failures = 0
            self._retry_at = 0.0
        return delivered
