"""Timing helpers shared by the studies: medians of repeated runs, with a time budget."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


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
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    times: list[float] = []
    spent = 0.0
    while len(times) < max(1, repeat) and (not times or spent < budget_s):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
    return statistics.median(times)


def geomean(values: list[float]) -> float:
    """Geometric mean of positive values (nan for an empty list)."""
    pos = [v for v in values if v > 0]
    if not pos:
        return float("nan")
    return float(statistics.geometric_mean(pos))
