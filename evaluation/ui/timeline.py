"""A trace's span tree as an SVG timeline, drawn on the server.

One row per span, depth-first (gateway -> worker -> model -> layers -> kernels), indented by
depth in the name column; the bar's position and length are its start and duration on the
trace's clock; its colour is its level. Each bar has a ``<title>`` (name, level, duration,
track) that browsers show on hover and screen readers read. Traces with more spans than
``max_rows`` show the first ``max_rows`` rows of the walk and say so.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

from trims.tracing.levels import Level
from trims.tracing.spans import Span, Trace

__all__ = ["LEVEL_COLOURS", "Timeline", "timeline_svg"]

#: level -> bar colour (each at least 3:1 against white)
LEVEL_COLOURS: dict[Level, str] = {
    Level.SERVICE: "#5b3f8c",
    Level.MODEL: "#0072B2",
    Level.LAYER: "#009E73",
    Level.LIBRARY: "#B35900",
    Level.KERNEL: "#C0307F",
    Level.FULL: "#555555",
    Level.NONE: "#555555",
}
_NAME_W = 300
_BAR_W = 760
_ROW_H = 18
_TOP = 28
_INDENT = 12
_NAME_CHARS = 38


@dataclass(frozen=True)
class Timeline:
    svg: str
    rows: int
    total_spans: int


def _fmt_ms(ns: float) -> str:
    ms = ns / 1e6
    return f"{ms:.3f} ms" if ms < 10 else f"{ms:.1f} ms"


def timeline_svg(trace: Trace, *, max_rows: int = 1500) -> Timeline:
    """The timeline of ``trace`` (at most ``max_rows`` spans)."""
    rows: list[tuple[int, Span]] = []
    for depth, span in trace.walk():
        if len(rows) >= max_rows:
            break
        rows.append((depth, span))
    if not trace.spans:
        return Timeline('<p class="empty">This trace has no spans.</p>', 0, 0)
    t0 = min(s.start_ns for s in trace.spans)
    t1 = max(s.end_ns for s in trace.spans)
    total = max(1, t1 - t0)
    width = _NAME_W + _BAR_W + 20
    height = _TOP + _ROW_H * len(rows) + 8
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" role="img" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'aria-label="Timeline of {len(rows)} spans over {escape(_fmt_ms(total))}">',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
    ]
    for k in range(6):
        x = _NAME_W + _BAR_W * k / 5
        out.append(
            f'<line x1="{x:.1f}" y1="{_TOP - 6}" x2="{x:.1f}" y2="{height - 4}" '
            'stroke="#d0d0d0" stroke-width="1"/>'
            f'<text x="{x:.1f}" y="{_TOP - 10}" font-size="11" fill="#333333" '
            f'text-anchor="middle">{escape(_fmt_ms(total * k / 5))}</text>'
        )
    for row, (depth, span) in enumerate(rows):
        y = _TOP + row * _ROW_H
        x = _NAME_W + _BAR_W * (span.start_ns - t0) / total
        w = max(1.0, _BAR_W * span.duration_ns / total)
        name = (
            span.name
            if len(span.name) <= _NAME_CHARS - depth
            else (span.name[: max(4, _NAME_CHARS - depth - 1)] + "…")
        )
        colour = LEVEL_COLOURS.get(span.level, "#555555")
        tip = (
            f"{span.name} ({span.level.label}): {_fmt_ms(span.duration_ns)} on "
            f"{span.track[0]} / {span.track[1]}"
        )
        out.append(
            f'<g class="span" data-level="{escape(span.level.label)}">'
            f"<title>{escape(tip)}</title>"
            f'<text x="{4 + min(depth, 12) * _INDENT}" y="{y + 13}" font-size="12" '
            f'fill="#1a1a1a" class="span-name">{escape(name)}</text>'
            f'<rect x="{x:.2f}" y="{y + 3}" width="{w:.2f}" height="{_ROW_H - 6}" '
            f'fill="{colour}"/></g>'
        )
    out.append("</svg>")
    return Timeline("".join(out), len(rows), len(trace.spans))
