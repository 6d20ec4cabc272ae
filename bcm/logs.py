"""Server logging: bcm's own loggers at the chosen level, libraries (asyncssh, uvicorn, alembic …) at
WARNING unless the level is debug, and never the text of a script bcm runs on a node.

asyncssh logs every command it sends ("Command: …"); those records are rewritten to the command's name
(:func:`script_name`) even at debug, since a script may embed node-specific details an operator's log
collector should not keep.
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
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


def configure(level: str) -> str:
    """Set up the root handler; returns the level to give uvicorn for its own loggers."""
    wanted = level_number(level)
    debug = wanted <= logging.DEBUG
    logging.basicConfig(level=wanted if debug else logging.WARNING, format=FORMAT, force=True)
    logging.getLogger("bcm").setLevel(wanted)
    for handler in logging.getLogger().handlers:
        handler.addFilter(ScriptNames())
    return level.lower() if debug else "warning"
