"""Plots (matplotlib, Agg backend): layer breakdown, bounds vs measured, estimation error."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trims.evaluation.analyzer import ModelBound
    from trims.evaluation.bricks import BrickStudy


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def layer_breakdown(bounds: list[ModelBound], path: Path) -> Path:
    """Stacked bar per model: best per-layer time summed by op type."""
    plt = _pyplot()
    ops = sorted({t.op_type for b in bounds for t in b.layers})
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bottom = [0.0] * len(bounds)
    for op in ops:
        values = [sum(t.best_ms for t in b.layers if t.op_type == op) for b in bounds]
        if not any(values):
            continue
        ax.bar([b.name for b in bounds], values, bottom=bottom, label=op)
        bottom = [x + y for x, y in zip(bottom, values, strict=True)]
    ax.set_ylabel("sum of best layer times (ms)")
    ax.set_yscale("log")
    ax.set_title("Per-layer latency breakdown by op type")
    ax.legend(fontsize=7, ncol=2)
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bounds_vs_measured(bounds: list[ModelBound], path: Path) -> Path:
    """Grouped bars per model: measured, sequential and parallel lower bound."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = range(len(bounds))
    width = 0.27
    series = [
        ("measured", [b.measured_ms for b in bounds]),
        ("sequential LB", [b.sequential_lb_ms for b in bounds]),
        ("parallel LB", [b.parallel_lb_ms for b in bounds]),
    ]
    for k, (label, values) in enumerate(series):
        ax.bar([x + (k - 1) * width for x in xs], values, width, label=label)
    ax.set_xticks(list(xs), [b.name for b in bounds], rotation=30)
    ax.set_yscale("log")
    ax.set_ylabel("latency (ms)")
    ax.set_title("Measured latency vs lower bounds (ONNX Runtime, CPU, batch 1)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def estimation_error(studies: list[BrickStudy], path: Path) -> Path:
    """Brick reconstruction error per model with its 95% interval, a series per granularity."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for k, s in enumerate(studies):
        errors = [m.error_pct for m in s.models]
        intervals = [m.error_ci_pct for m in s.models]
        ax.errorbar(
            [i + 0.12 * (k - (len(studies) - 1) / 2) for i in range(len(s.models))],
            errors,
            yerr=[
                [e - lo for e, (lo, _) in zip(errors, intervals, strict=True)],
                [hi - e for e, (_, hi) in zip(errors, intervals, strict=True)],
            ],
            fmt="o",
            capsize=3,
            label=f"G={s.granularity}",
        )
    ax.set_xticks(range(len(studies[0].models)), [m.name for m in studies[0].models])
    ax.axhline(10, color="grey", linestyle="--")
    ax.axhline(-10, color="grey", linestyle="--")
    ax.set_ylabel("estimated vs measured (%)")
    ax.set_title("Brick reconstruction error per model")
    ax.legend()
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
