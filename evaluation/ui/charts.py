"""Charts as inline SVG (matplotlib, Agg, text kept as text): what the pages plot.

Every chart comes back as ``<svg ...>`` markup ready to place in a page: its element ids are
prefixed with the chart's name (several charts share one page), it carries ``role="img"`` and
an ``aria-label``, and every bar is a group with id ``<chart>-bar-<series>-<i>`` so a test (or
a stylesheet) finds the bars. Pages show the numbers in a table beside each chart too.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from html import escape
from typing import Any

__all__ = ["grouped_bars", "scatter", "stacked_bars"]

#: colour-blind-safe palette (Okabe-Ito), dark enough on white for the 3:1 graphics contrast
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _svg(fig: Any, name: str, label: str) -> str:
    """The figure as inline SVG markup, ids prefixed with ``name``, labelled ``label``."""
    plt = _pyplot()
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    text = re.sub(r'\bid="', f'id="{name}-', text)
    text = text.replace("url(#", f"url(#{name}-").replace('href="#', f'href="#{name}-')
    return text.replace("<svg ", f'<svg role="img" aria-label="{escape(label)}" class="chart" ', 1)


def _figure(width: float, height: float) -> tuple[Any, Any]:
    fig, ax = _pyplot().subplots(figsize=(width, height))
    fig.set_layout_engine("tight")
    ax.spines[["top", "right"]].set_visible(False)
    return fig, ax


def grouped_bars(
    name: str,
    title: str,
    categories: Sequence[str],
    series: Sequence[tuple[str, Sequence[float]]],
    ylabel: str,
) -> str:
    """One group of bars per category, one bar per series."""
    plt = _pyplot()
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "trims-ui"}):
        n = max(1, len(series))
        fig, ax = _figure(max(4.5, 0.9 * len(categories) + 2.5) + (1.8 if n > 1 else 0), 3.4)
        width = 0.8 / n
        xs = range(len(categories))
        for k, (label, values) in enumerate(series):
            bars = ax.bar(
                [x + (k - (n - 1) / 2) * width for x in xs],
                values,
                width,
                label=label,
                color=PALETTE[k % len(PALETTE)],
            )
            for i, bar in enumerate(bars):
                bar.set_gid(f"bar-{k}-{i}")
        ax.set_xticks(list(xs), list(categories), rotation=20, ha="right")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if n > 1:
            ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1, 1))
        return _svg(fig, name, title)


def stacked_bars(
    name: str,
    title: str,
    categories: Sequence[str],
    series: Sequence[tuple[str, Sequence[float]]],
    ylabel: str,
) -> str:
    """One bar per category, stacked from the series (e.g. time by op type per model)."""
    plt = _pyplot()
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "trims-ui"}):
        fig, ax = _figure(max(4.5, 0.8 * len(categories) + 3.5), 3.6)
        bottom = [0.0] * len(categories)
        for k, (label, values) in enumerate(series):
            bars = ax.bar(
                list(categories),
                values,
                bottom=bottom,
                label=label,
                color=PALETTE[k % len(PALETTE)],
            )
            for i, bar in enumerate(bars):
                bar.set_gid(f"bar-{k}-{i}")
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.tick_params(axis="x", rotation=20)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(frameon=False, fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1, 1))
        return _svg(fig, name, title)


def scatter(
    name: str,
    title: str,
    points: Sequence[tuple[str, float, float]],
    xlabel: str,
    ylabel: str,
) -> str:
    """Labelled points ``(label, x, y)``."""
    plt = _pyplot()
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "trims-ui"}):
        fig, ax = _figure(5.5, 3.6)
        for k, (label, x, y) in enumerate(points):
            ax.scatter([x], [y], color=PALETTE[k % len(PALETTE)], s=40, gid=f"point-{k}")
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.margins(0.2)
        return _svg(fig, name, title)
