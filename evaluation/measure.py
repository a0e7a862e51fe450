"""Timing: warm up, repeat until the estimate is stable or a time budget is spent, summarize.

The summary is the 20% trimmed mean (drop the fastest and slowest 20%, average the rest), which
ignores both lucky cache-warm outliers and scheduler hiccups on a shared machine. "Stable" means
the 95% confidence half-width of the median (1.57 * IQR / sqrt(n), the notch rule) is below
``rel_tol`` of the median or below ``abs_tol_ms``, whichever is larger: a 0.1 ms layer does not
need 2% precision (2 us) to estimate a model of tens of milliseconds, and chasing it would
spend its whole time budget on noise.

Clock. On a shared machine a run is often preempted, and a 20 ms model run is preempted far
more often than a 0.2 ms layer run, which biases every whole-vs-parts comparison. With one
intra-op thread the frameworks compute on the calling thread, so the default clock is that
thread's CPU time (``CLOCK_THREAD_CPUTIME_ID``): it counts the work done, not the time spent
waiting for a core. Use ``clock="wall"`` for multi-threaded variants.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MeasureSettings:
    """How long to measure one benchmark."""

    #: runs discarded before timing (first runs allocate, fault pages in, pick kernels)
    warmup: int = 2
    #: never stop with fewer timed runs than this
    min_reps: int = 7
    #: never time more runs than this
    max_reps: int = 200
    #: stop once this many seconds (warm-up included) were spent, if min_reps are done
    max_time_s: float = 1.0
    #: stop once the median's 95% confidence half-width is below this fraction of it
    rel_tol: float = 0.02
    #: ...or below this many milliseconds
    abs_tol_ms: float = 0.02
    #: fraction dropped at each end for the trimmed mean
    trim: float = 0.2
    #: "thread" (CPU time of the calling thread) or "wall" (perf_counter)
    clock: str = "thread"

    def timer(self) -> Callable[[], float]:
        """The clock function per :attr:`clock`."""
        if self.clock == "thread":
            return time.thread_time
        if self.clock == "wall":
            return time.perf_counter
        raise ValueError(f"unknown clock {self.clock!r}; use 'thread' or 'wall'")


@dataclass(frozen=True)
class Measurement:
    """Summary of one benchmark, in milliseconds."""

    trimmed_mean_ms: float
    median_ms: float
    spread_ms: float
    min_ms: float
    reps: int
    elapsed_s: float


def trimmed_mean(samples: list[float] | np.ndarray, trim: float = 0.2) -> float:
    """Mean of the samples after dropping ``trim`` of them at each end."""
    values = np.sort(np.asarray(samples, dtype=np.float64))
    if values.size == 0:
        raise ValueError("trimmed_mean of no samples")
    cut = math.floor(values.size * trim)
    kept = values[cut : values.size - cut] if values.size - 2 * cut > 0 else values
    return float(kept.mean())


def _stable(samples: list[float], rel_tol: float, abs_tol_s: float) -> bool:
    q1, median, q3 = np.percentile(samples, [25, 50, 75])
    half_width = 1.57 * (q3 - q1) / math.sqrt(len(samples))
    return bool(half_width <= max(rel_tol * median, abs_tol_s))


def summarize(samples_s: list[float], elapsed_s: float, trim: float = 0.2) -> Measurement:
    """Turn per-run seconds into a :class:`Measurement`."""
    ms = np.asarray(samples_s, dtype=np.float64) * 1e3
    q1, median, q3 = np.percentile(ms, [25, 50, 75])
    return Measurement(
        trimmed_mean_ms=trimmed_mean(ms, trim),
        median_ms=float(median),
        spread_ms=float(q3 - q1),
        min_ms=float(ms.min()),
        reps=int(ms.size),
        elapsed_s=elapsed_s,
    )


def measure(fn: Callable[[], object], settings: MeasureSettings | None = None) -> Measurement:
    """Time ``fn`` per :class:`MeasureSettings`; ``elapsed_s`` (same clock) includes warm-up."""
    s = settings or MeasureSettings()
    clock = s.timer()
    start = clock()
    for _ in range(s.warmup):
        fn()
    samples: list[float] = []
    while len(samples) < s.max_reps:
        t0 = clock()
        fn()
        t1 = clock()
        samples.append(t1 - t0)
        if len(samples) < s.min_reps:
            continue
        if t1 - start >= s.max_time_s or _stable(samples, s.rel_tol, s.abs_tol_ms / 1e3):
            break
    return summarize(samples, clock() - start, s.trim)
