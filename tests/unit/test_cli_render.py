"""cli.render prints data as text: no markup, no emoji, control characters shown escaped, whatever
renderable carries them (a table, a progress bar); rich's own cursor codes still work."""

from __future__ import annotations

import io

from rich.progress import Progress, TextColumn
from rich.table import Table

from cli.render import SafeConsole, gib, plain, safe

HOSTILE = "\x1b]0;pwned\x07[bold]x[/bold] :ab: \x1b]8;;http://e/\x1b\\l\x1b]8;;\x1b\\ a\u202eb \x9b2J"
SHOWN = r"\x1b]0;pwned\x07[bold]x[/bold] :ab: \x1b]8;;http://e/\x1b\l\x1b]8;;\x1b\ a\u202eb \x9b2J"


def console(terminal: bool = False) -> tuple[SafeConsole, io.StringIO]:
    buffer = io.StringIO()
    return SafeConsole(file=buffer, width=300, force_terminal=terminal, color_system=None), buffer


def test_plain_and_safe_escape_every_control_character() -> None:
    assert plain(HOSTILE) == SHOWN
    assert plain("a\nb\tc") == r"a\x0ab\x09c" and plain("a\nb\tc", lines=True) == "a\nb\tc"
    assert plain(None) == "" and plain(5) == "5"
    text = safe(HOSTILE, style="red")
    assert text.plain == SHOWN and str(text.style) == "red" and not text.spans


def test_strings_tables_and_titles_print_as_text() -> None:
    con, buffer = console()
    con.print(HOSTILE)
    t = Table(title=HOSTILE)
    t.add_column(HOSTILE)
    t.add_row(HOSTILE)  # a table built without safe(): the console still escapes its cells
    con.print(t)
    shown = buffer.getvalue()
    assert "\x1b" not in shown and "\x07" not in shown and "\u202e" not in shown and "\x9b" not in shown
    assert shown.count("[bold]x[/bold]") == 4 and ":ab:" in shown and "\U0001f18e" not in shown


def test_a_progress_bar_description_is_escaped_and_its_own_codes_kept() -> None:
    con, buffer = console(terminal=True)
    with Progress(TextColumn("{task.description}", markup=False), console=con, auto_refresh=False) as bar:
        bar.add_task(HOSTILE, total=1)
        bar.refresh()
    shown = buffer.getvalue()
    assert r"\x1b]0;pwned" in shown  # (rich drops the BEL itself)
    assert "\x1b]0;" not in shown and "\x07" not in shown  # no window title was set
    assert "\x1b[?25l" in shown  # rich's own code (hide the cursor) still reaches the terminal


def test_byte_counts_that_are_no_byte_counts_show_as_a_question_mark() -> None:
    assert gib(3 * 2**30) == "3.0" and gib(10 * 2**30, 0) == "10"
    assert gib(int("9" * 4000)) == "?" and gib(-1) == "?" and gib("12") == "?" and gib(True) == "?"
    assert gib(None) is None
