"""Output helpers: rich tables for people, --json for scripts."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

# piped output keeps whole rows (rich would fold at 80 columns)
_WIDTH = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "200"))
out = Console(highlight=False, width=_WIDTH)
err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 200)


def emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    t = Table(title=title, header_style="bold", show_lines=False)
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*["" if v is None else str(v) for v in r])
    out.print(t)


def kv(title: str, pairs: Iterable[tuple[str, Any]]) -> None:
    t = Table(title=title, show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    for k, v in pairs:
        t.add_row(k, "" if v is None else str(v))
    out.print(t)
