"""Server logging: bcm's own loggers at the chosen level, libraries (asyncssh, uvicorn, alembic …) at
WARNING unless the level is debug, and never the text of a script bcm runs on a node.

Two formats: ``text`` (one line: time, level, logger, message) and ``json`` (``BCM_LOG_FORMAT=json``): one
JSON object a line with ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message`` and, when a record
carries one, ``exception`` (the traceback as text), for a log collector (journald, Loki, Elasticsearch).
Both go through the same filters, so what is kept out of one is kept out of the other.

asyncssh logs every command it sends ("Command: …"); those records are rewritten to the command's name
(:func:`script_name`) even at debug, since a script may embed node-specific details an operator's log
collector should not keep.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMATS = ("text", "json")
_COMMAND_MESSAGES = ("Command: %s", "Subsystem: %s")


def script_name(command: str) -> str:
    """A command as logs show it: its ``# bcm: NAME`` line if it has one, else its first word and size."""
    for line in command.splitlines():
        stripped = line.strip()
        if stripped.startswith("# bcm:"):
            return stripped.removeprefix("# bcm:").strip()[:60] or "script"
    words = command.split(None, 1)
    first = words[0][:40] if words else "(empty)"
    return first if len(words) < 2 else f"{first} … ({len(command)} bytes)"


class ScriptNames(logging.Filter):
    """Replaces the command text in asyncssh's "Command: …" records with :func:`script_name`."""

    def filter(self, record: logging.LogRecord) -> bool:
        command = (
            record.name.startswith("asyncssh")
            and isinstance(record.msg, str)
            and record.msg.endswith(_COMMAND_MESSAGES)
            and isinstance(record.args, tuple)
            and bool(record.args)
        )
        if command:
            assert isinstance(record.args, tuple)
            record.args = (script_name(str(record.args[0])), *record.args[1:])
        return True


def level_number(level: str) -> int:
    """``debug``, ``info``, ``warning`` or ``error`` (any case) as logging's number; ValueError otherwise."""
    wanted = logging.getLevelName(level.upper())
    if not isinstance(wanted, int):
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning or error")
    return wanted


class JsonLines(logging.Formatter):
    """A record as one line of JSON: time, level, logger, message, and exception (with stack) if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        # ensure_ascii: a control character or a bidi override in a message stays an escape, never raw text
        return json.dumps(entry, ensure_ascii=True, default=str)


def check_format(fmt: str) -> str:
    """``text`` or ``json`` (any case), lower-cased; ValueError otherwise."""
    if fmt.lower() not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; use text or json")
    return fmt.lower()


def configure(level: str, fmt: str = "text") -> str:
    """Set up the root handler; returns the level to give uvicorn for its own loggers."""
    wanted = level_number(level)
    debug = wanted <= logging.DEBUG
    logging.basicConfig(level=wanted if debug else logging.WARNING, format=FORMAT, force=True)
    logging.getLogger("bcm").setLevel(wanted)
    for handler in logging.getLogger().handlers:
        handler.addFilter(ScriptNames())
        if check_format(fmt) == "json":
            handler.setFormatter(JsonLines())
    return level.lower() if debug else "warning"
