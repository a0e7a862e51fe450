"""Timing helpers shared by the studies: medians of repeated runs, with a time budget.

The runs and the clock are :mod:`trims.timing`'s: the wall clock, since a study's kernels run
on thread pools or a GPU stream and the figure is the time a caller waits.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from trims import timing


def median_seconds(
    fn: Callable[[], object],
    *,
    repeat: int = 5,
    warmup: int = 1,
    budget_s: float = 2.0,
    sync: Callable[[], None] | None = None,
) -> float:
    """Median wall time of ``fn()`` over at most ``repeat`` runs (at least one) after ``warmup``.

    Stops early once ``budget_s`` seconds have been spent, so large sizes stay affordable.
    ``sync`` (for example a CUDA stream synchronize) runs before each clock read.
    """
    samples = timing.time_runs(fn, repeat=repeat, warmup=warmup, budget_s=budget_s, sync=sync)
    return timing.summarize(samples).median_s


def geomean(values: list[float]) -> float:
    """Geometric mean of positive values (nan for an empty list)."""
    pos = [v for v in values if v > 0]
    if not pos:
        return float("nan")
    return float(statistics.geometric_mean(pos))
