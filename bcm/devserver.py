"""Start a local `bcm serve` process and drive the real CLI against it (tests, benchmarks, the lab)."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

BCM = [sys.executable, "-m", "cli.main"]
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    state_dir: Path
    database_url: str | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"  # where it listens; clients always use loopback
    argv: list[str] = field(
        default_factory=lambda: list(BCM)
    )  # the bcm it runs (an installed one: its bin/bcm)
    cwd: Path = REPO
    tls: bool = False  # the API over https (BCM_TLS__ENABLED), boot files on boot_port
    boot_port: int = field(default_factory=free_port)
    ca_file: Path | None = None  # what start() verifies the API against (default: bcm's CA in the state dir)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def boot_url(self) -> str:
        return f"http://127.0.0.1:{self.boot_port if self.tls else self.port}"

    def verify(self) -> ssl.SSLContext | bool:
        """How a test client verifies the API: bcm's CA (or ``ca_file``) over https."""
        if not self.tls:
            return True
        return ssl.create_default_context(cafile=str(self.ca_file or self.state_dir / "tls" / "ca.crt"))

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("BCM_")}
        env.update(
            BCM_STATE_DIR=str(self.state_dir), BCM_URL=self.url, BCM_PORT=str(self.port), COLUMNS="200"
        )
        if self.database_url:
            env["BCM_DATABASE_URL"] = self.database_url
        if self.tls:
            env.update(BCM_TLS__ENABLED="true", BCM_TLS__BOOT_PORT=str(self.boot_port))
        env.update(self.extra_env)
        env.update(extra)
        return env

    def start(self) -> None:
        self.log = self.state_dir.parent / f"server-{self.port}.log"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.argv, "serve", "--host", self.host],
                env=self.env(),
                cwd=self.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # bounded wait for the server to answer
            if self.proc.poll() is not None:
                raise RuntimeError(f"bcm serve exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1, verify=self.verify()).status_code == 200:
                    return
            except (httpx.HTTPError, OSError):  # OSError: bcm's CA not written yet
                pass
            time.sleep(0.2)
        raise RuntimeError(f"bcm serve did not answer within 30 s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def token(self) -> str:
        return (self.state_dir / "admin.token").read_text().strip()

    def cli(self, *args: str, input: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.argv, *args],
            env=self.env(**env),
            cwd=self.cwd,
            capture_output=True,
            text=True,
            input=input,
            timeout=120,
        )
