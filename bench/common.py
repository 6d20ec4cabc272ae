"""Helpers shared by the benchmarks (run as `python bench/NAME.py`, so this folder is on sys.path)."""

from __future__ import annotations


def pct(values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank) of some timings."""
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]
