"""A real `bcm serve` process on loopback, and a runner for the real `bcm` CLI."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bcm.devserver import Server

__all__ = ["Server"]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path / "state")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
