"""Category → node inheritance: one pure function computes a node's effective settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

INHERITED_FIELDS = (
    "image",
    "kernel_args",
    "wlm_role",
    "boot_mode",
    "bmc_protocol",
    "bmc_user",
    "install_mode",
)
DEFAULTS: dict[str, Any] = {
    "image": None,
    "kernel_args": "",
    "wlm_role": "compute",
    "boot_mode": "pxe",
    "bmc_protocol": None,
    "bmc_user": None,
    "install_mode": "stateless",
}


@dataclass(frozen=True)
class Effective:
    """A node's settings after inheritance, and where each came from."""

    values: dict[str, Any]
    sources: dict[str, str]  # field -> "node" | "category" | "default"


def effective_settings(node: dict[str, Any], category: dict[str, Any] | None) -> Effective:
    """Node fields override category defaults, which override built-in defaults; None means unset."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for field in INHERITED_FIELDS:
        if node.get(field) is not None:
            values[field], sources[field] = node[field], "node"
        elif category is not None and category.get(field) is not None:
            values[field], sources[field] = category[field], "category"
        else:
            values[field], sources[field] = DEFAULTS[field], "default"
    return Effective(values, sources)
