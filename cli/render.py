"""Output helpers: rich tables for people, --json for scripts.

What the CLI prints comes from the server, and much of it from machines nobody authenticated (a discovered
machine's facts, a node's report): it is printed as text, never as rich markup or emoji, and control
characters (terminal escapes, OSC-8 links, window titles, bidi overrides) are shown escaped, ``\\x1b``.
:func:`safe` makes one value into such a text; :data:`out` and :data:`err` print every string that way and
escape any control character that reaches them in another renderable (a progress bar's description, a
table built elsewhere), so a caller cannot forget. Styles (red errors, verdict colours) are set with
``style=``, never with markup in a string. ``--json`` escapes control characters as JSON does.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from rich.console import Console
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

# C0 and C1 controls, DEL, and the bidirectional overrides that reorder what a terminal shows
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_UNSAFE_BUT_NEWLINE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def plain(value: Any, *, lines: bool = False) -> str:
    """``value`` as a string with every control character shown escaped (``\\x1b``); newlines and tabs
    kept with ``lines``. The string is for :class:`rich.text.Text` or a console here, never for markup."""
    text = "" if value is None else str(value)
    return (_UNSAFE_BUT_NEWLINE if lines else _UNSAFE).sub(_escape, text)


def safe(value: Any, *, lines: bool = False, style: str = "") -> Text:
    """``value`` as rich text: no markup, no emoji, control characters shown escaped."""
    if isinstance(value, Text):
        return Text(plain(value.plain, lines=lines), style=style or value.style)
    return Text(plain(value, lines=lines), style=style)


def _escaped(buffer: Iterable[Segment]) -> Iterator[Segment]:
    for segment in buffer:
        text, style, control = segment
        # rich's own cursor and screen codes (progress bars, live views) are control segments: kept
        if control is None and _UNSAFE_BUT_NEWLINE.search(text):
            yield Segment(plain(text, lines=True), style)
        else:
            yield segment


class SafeConsole(Console):
    """A console that prints strings as text (no markup, no emoji) and escapes control characters."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(markup=False, emoji=False, highlight=False, **kwargs)

    def print(self, *objects: Any, **kwargs: Any) -> None:  # type: ignore[override]
        super().print(*(safe(o, lines=True) if isinstance(o, str) else o for o in objects), **kwargs)

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        # the last step before the terminal: whatever renderable carried a control character, it is shown
        return super()._render_buffer(_escaped(buffer))


# piped output keeps whole rows (rich would fold at 80 columns)
_WIDTH = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "200"))
out = SafeConsole(width=_WIDTH)
err = SafeConsole(stderr=True, width=None if sys.stderr.isatty() else 200)


def gib(value: Any, digits: int = 1) -> str | None:
    """A byte count in GiB; a value that is no byte count (a 4,000-digit number) is shown as ``?``."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**64:
        return "?"
    return f"{value / 2**30:.{digits}f}"


def emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


def cell(value: Any) -> Text:
    """A table cell: a value as safe text (text the CLI styled keeps its style)."""
    return safe(value)


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    t = Table(title=None if title is None else safe(title), header_style="bold", show_lines=False)
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*[cell(v) for v in r])
    out.print(t)


def kv(title: str, pairs: Iterable[tuple[str, Any]]) -> None:
    t = Table(title=safe(title), show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    for k, v in pairs:
        t.add_row(safe(k), cell(v))
    out.print(t)
