"""The lab's one error type: a lab step failed (a command, a timeout, a missing tool)."""

from __future__ import annotations

from bcm.errors import FatalDriverError


class LabError(FatalDriverError):
    """Bringing up, inspecting or tearing down the lab failed; the message says which step and why."""
