"""Test helper: change one value deep inside recorded JSON, addressed as ``gpus.1.ecc_errors.volatile``."""

from __future__ import annotations

from typing import Any


def set_path(data: Any, path: str, value: Any) -> Any:
    """Set ``value`` at ``path`` (dict keys and list indexes joined by dots) in place; returns ``data``."""
    node: Any = data
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(keys[-1])] = value
    else:
        node[keys[-1]] = value
    return data
