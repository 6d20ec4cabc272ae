"""Inline SVG charts of a GPU's history, drawn on the server (no script, no library, nothing fetched).

Pure functions: samples in, SVG text out. Every label is escaped; numbers are formatted by us. Colours
come from CSS classes (``chart-line``, ``chart-mark`` …), so light and dark themes apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from html import escape
from typing import Protocol

from markupsafe import Markup

WIDTH, HEIGHT = 640, 150
MAX_POINTS = 320  # about two pixels a point: more readings than this are thinned, keeping each bucket's peak


class Sample(Protocol):
    """What a chart reads of one GPU reading (``HealthSamplePublic`` and ``queries.Reading`` have it)."""

    @property
    def time(self) -> datetime: ...
    @property
    def temperature_c(self) -> int | None: ...
    @property
    def power_draw_w(self) -> float | None: ...
    @property
    def ecc_sbe_volatile(self) -> int | None: ...
    @property
    def ecc_dbe_volatile(self) -> int | None: ...
    @property
    def xid(self) -> int | None: ...


Series = Sequence[tuple[datetime, float | None]]


def thin(points: Series, limit: int = MAX_POINTS) -> Series:
    """At most ``limit`` points: the readings split into that many runs, each run's highest value kept (a
    spike stays visible), a run with no value kept as a gap."""
    if len(points) <= limit:
        return points
    out: list[tuple[datetime, float | None]] = []
    step = len(points) / limit
    for b in range(limit):
        run = points[int(b * step) : int((b + 1) * step)]
        values = [p for p in run if p[1] is not None]
        out.append(max(values, key=lambda p: float(p[1] or 0)) if values else (run[0][0], None))
    return out


LEFT, RIGHT, TOP, BOTTOM = 48, 12, 12, 28


def _x(t: float, t0: float, t1: float) -> float:
    span = (t1 - t0) or 1.0
    return LEFT + (t - t0) / span * (WIDTH - LEFT - RIGHT)


def _y(v: float, lo: float, hi: float) -> float:
    span = (hi - lo) or 1.0
    return TOP + (1 - (v - lo) / span) * (HEIGHT - TOP - BOTTOM)


def _num(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 10 or v == int(v) else f"{v:.1f}"


def _frame(title: str, lo: float, hi: float, t0: datetime, t1: datetime, unit: str) -> list[str]:
    label = escape(title)
    return [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{label}" '
        f'xmlns="http://www.w3.org/2000/svg"><title>{label}</title>',
        f'<line class="chart-axis" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{HEIGHT - BOTTOM}"/>',
        f'<line class="chart-axis" x1="{LEFT}" y1="{HEIGHT - BOTTOM}" x2="{WIDTH - RIGHT}" y2="{HEIGHT - BOTTOM}"/>',
        f'<text class="chart-text" x="{LEFT - 4}" y="{TOP + 4}" text-anchor="end">{escape(_num(hi))}</text>',
        f'<text class="chart-text" x="{LEFT - 4}" y="{HEIGHT - BOTTOM}" text-anchor="end">{escape(_num(lo))}</text>',
        f'<text class="chart-text" x="{LEFT - 4}" y="{(HEIGHT - BOTTOM + TOP) / 2 + 4:.0f}" '
        f'text-anchor="end">{escape(unit)}</text>',
        f'<text class="chart-text" x="{LEFT}" y="{HEIGHT - 8}">{escape(t0.strftime("%m-%d %H:%M:%S"))}</text>',
        f'<text class="chart-text" x="{WIDTH - RIGHT}" y="{HEIGHT - 8}" text-anchor="end">'
        f"{escape(t1.strftime('%m-%d %H:%M:%S'))}</text>",
    ]


def line_chart(title: str, unit: str, series: Sequence[tuple[str, Series]]) -> Markup:
    """One or more named series over time (oldest first); gaps where a value is missing."""
    series = [(name, thin(s)) for name, s in series]
    points = [(t, v) for _name, s in series for t, v in s if v is not None]
    if not points:
        return Markup(f'<p class="muted">{escape(title)}: no readings yet</p>')  # noqa: S704 - escaped above
    times = [t.timestamp() for t, _ in points]
    t0, t1 = min(times), max(times)
    values = [float(v) for _, v in points if v is not None]
    lo, hi = min(0.0, min(values)), max(values)
    hi = hi if hi > lo else lo + 1
    first = min((t for t, _ in points), key=lambda t: t.timestamp())
    last = max((t for t, _ in points), key=lambda t: t.timestamp())
    parts = _frame(title, lo, hi, first, last, unit)
    for i, (name, s) in enumerate(series):
        runs: list[list[str]] = [[]]
        for t, v in s:
            if v is None:
                runs.append([])
                continue
            runs[-1].append(f"{_x(t.timestamp(), t0, t1):.1f},{_y(float(v), lo, hi):.1f}")
        for run in runs:
            if len(run) == 1:
                x, y = run[0].split(",")
                parts.append(f'<circle class="chart-line s{i}" cx="{x}" cy="{y}" r="2"/>')
            elif run:
                parts.append(f'<polyline class="chart-line s{i}" points="{" ".join(run)}"/>')
        if len(series) > 1:
            parts.append(
                f'<text class="chart-text s{i}" x="{WIDTH - RIGHT - 90 * (len(series) - i) + 90}" '
                f'y="{TOP + 10}" text-anchor="end">{escape(name)}</text>'
            )
    parts.append("</svg>")
    return Markup("".join(parts))  # noqa: S704 - every text above is escaped, every number ours


def event_chart(
    title: str, events: Sequence[tuple[datetime, int]], span: tuple[datetime, datetime] | None
) -> Markup:
    """XID events as marks on the history's time axis, each labelled with its code."""
    if not events:
        return Markup(f'<p class="muted">{escape(title)}: none in the history kept</p>')  # noqa: S704
    first, last = span or (min(t for t, _ in events), max(t for t, _ in events))
    t0, t1 = first.timestamp(), last.timestamp()
    parts = _frame(title, 0, 1, first, last, "")
    for t, code in events:
        x = _x(t.timestamp(), t0, t1)
        parts.append(
            f'<line class="chart-mark" x1="{x:.1f}" y1="{TOP + 14}" x2="{x:.1f}" y2="{HEIGHT - BOTTOM}"/>'
        )
        parts.append(
            f'<text class="chart-text" x="{x:.1f}" y="{TOP + 10}" text-anchor="middle">{int(code)}</text>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))  # noqa: S704


def gpu_charts(samples: Sequence[Sample]) -> dict[str, Markup]:
    """Temperature, power, ECC and XID charts of one GPU's samples (newest first, as the service gives)."""
    old_first = list(reversed(samples))
    span = (old_first[0].time, old_first[-1].time) if old_first else None
    xids = [(s.time, s.xid) for s in old_first if s.xid]
    return {
        "temperature": line_chart(
            "Temperature (°C)", "°C", [("temperature", [(s.time, s.temperature_c) for s in old_first])]
        ),
        "power": line_chart(
            "Power draw (W)", "W", [("power", [(s.time, s.power_draw_w) for s in old_first])]
        ),
        "ecc": line_chart(
            "ECC errors (volatile)",
            "count",
            [
                ("single-bit", [(s.time, s.ecc_sbe_volatile) for s in old_first]),
                ("double-bit", [(s.time, s.ecc_dbe_volatile) for s in old_first]),
            ],
        ),
        "xid": event_chart("XID events", [(t, x) for t, x in xids if x is not None], span),
    }
