"""Browser tests: a real `bcm serve` on loopback and Debian's Chromium driven by Playwright.

Chromium comes from apt (`chromium`, installed by scripts/test-all); Playwright only drives it
(``executable_path``), it never downloads a browser. Each page a test visits is saved as a screenshot
under ``$BCM_TEST_ARTIFACTS/ui`` (default ``tests/artifacts/ui``, ignored by git).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from bcm.devserver import Server

CHROMIUM = os.environ.get("BCM_TEST_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = (
    Path(os.environ.get("BCM_TEST_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts")) / "ui"
)


def _unavailable(why: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One Chromium per test module. Not per session: Playwright's sync API keeps an asyncio loop
    running in this thread while it lives, and tests run after the UI's (asyncio.run) would fail."""
    if not shutil.which(CHROMIUM):
        _unavailable(f"{CHROMIUM} is missing (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install -e '.[test]')")
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-background-networking", "--disable-gpu"],
        )
        try:
            yield b
        finally:
            b.close()


@dataclass
class Site:
    """A running server, an admin API client, and helpers to make tokens and sign in."""

    server: Server
    api: httpx.Client

    @property
    def url(self) -> str:
        return self.server.url

    def token(self, name: str, role: str) -> str:
        r = self.api.post("/api/v1/tokens", json={"name": name, "role": role})
        assert r.status_code == 201, r.text
        return str(r.json()["token"])

    def nodes(self, hostlist: str, state: str | None = "ready", **fields: Any) -> None:
        r = self.api.post("/api/v1/nodes/bulk", json={"nodes": hostlist, **fields})
        assert r.status_code == 201, r.text
        if state:  # database before: the nodes are in service, as after a workload-manager deploy
            self.sql("UPDATE node SET provision_state = :s", s=state)

    def sql(self, statement: str, **params: Any) -> list[Any]:
        engine = create_engine(f"sqlite:///{self.server.state_dir / 'bcm.db'}")
        try:
            with engine.begin() as conn:
                result = conn.execute(text(statement), params)
                return list(result) if result.returns_rows else []
        finally:
            engine.dispose()

    def state(self, name: str) -> str:
        return str(self.api.get(f"/api/v1/nodes/{name}").json()["provision_state"])


def start_site(tmp_path: Path, **env: str) -> Iterator[Site]:
    server = Server(tmp_path / "state", extra_env=env)
    server.start()
    api = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token()}"}, timeout=30)
    try:
        yield Site(server, api)
    finally:
        api.close()
        server.stop()


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    yield from start_site(tmp_path)


def sign_in(browser: Any, site: Site, token: str, start: str = "/ui/") -> Any:
    """A fresh browser context signed in with ``token`` through the sign-in form; its page."""
    context = browser.new_context(base_url=site.url, viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.goto(start)
    assert "/ui/signin" in page.url, page.url  # no session: the sign-in page first
    page.fill("#token", token)
    page.click("button[type=submit]")
    page.wait_for_load_state()
    return page


def shoot(page: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
