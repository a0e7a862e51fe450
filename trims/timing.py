"""Timing harness: one clock, warm-up, repeated runs until a stop rule, and one summary.

Every timing figure in the project (the evaluation's layer benchmarks, the kernel studies, the
runtime benchmarks) comes from :class:`Runs` and :func:`summarize`, so "median" and "95%
interval" mean the same everywhere.

Clocks (:data:`CLOCKS`):

``wall``
    ``time.perf_counter``: elapsed real time. Right for anything that waits (I/O, another
    process, a GPU stream, thread pools) and for what a user experiences (a cold start, a
    request's latency). The kernel studies and the runtime benchmarks use it.
``thread``
    ``time.thread_time``: CPU time of the calling thread. Right for single-threaded compute on
    a shared machine, where preemption adds wall time unrelated to the work: a 20 ms run is
    preempted far more often than a 0.2 ms one, which biases whole-vs-parts comparisons. The
    evaluation's layer benchmarks use it (one intra-op thread), ``wall`` for multi-threaded ones.

The interval is the median's 95% confidence interval by the notch rule,
``median +- 1.57 * IQR / sqrt(n)`` (McGill, Tukey and Larsen 1978): robust to the one
preempted run that would inflate a standard deviation.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["CLOCKS", "Runs", "Summary", "clock", "median_ci_half_width", "summarize", "time_runs"]

#: clock name -> function returning seconds
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}
#: the notch rule's factor: half-width of the median's 95% interval per IQR / sqrt(n)
NOTCH = 1.57


def clock(name: str) -> Callable[[], float]:
    """The clock function called ``name`` (see :data:`CLOCKS`)."""
    try:
        return CLOCKS[name]
    except KeyError:
        raise ValueError(f"unknown clock {name!r}; use one of {', '.join(CLOCKS)}") from None


def _quartiles(samples: Sequence[float]) -> tuple[float, float, float]:
    """Q1, median, Q3 with linear interpolation (NumPy's default percentile method)."""
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    q1, q2, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q1, q2, q3


def median_ci_half_width(samples: Sequence[float]) -> float:
    """Half-width of the median's 95% confidence interval (the notch rule)."""
    q1, _, q3 = _quartiles(samples)
    return NOTCH * (q3 - q1) / math.sqrt(len(samples))


@dataclass(frozen=True)
class Summary:
    """Summary of per-run seconds."""

    runs: int
    median_s: float
    min_s: float
    max_s: float
    #: interquartile range
    iqr_s: float
    #: the median's 95% confidence interval (notch rule)
    ci95_low_s: float
    ci95_high_s: float


def summarize(samples: Sequence[float]) -> Summary:
    """The :class:`Summary` of per-run seconds (at least one)."""
    if not samples:
        raise ValueError("no samples to summarize: time at least one run")
    q1, median, q3 = _quartiles(samples)
    half = median_ci_half_width(samples)
    return Summary(
        runs=len(samples),
        median_s=median,
        min_s=min(samples),
        max_s=max(samples),
        iqr_s=q3 - q1,
        ci95_low_s=median - half,
        ci95_high_s=median + half,
    )


#: a stop rule: (per-run seconds so far, seconds spent including warm-up) -> stop now?
StopRule = Callable[[list[float], float], bool]


class Runs:
    """``fn`` warmed up, then timed in rounds on one clock.

    ``sync`` (a CUDA stream synchronize, say) runs after the warm-up and inside each timed
    run, so asynchronous work is counted where it is done. ``spent_s`` is every second spent on
    the clock: warm-up and timed runs, nothing between rounds.
    """

    def __init__(
        self,
        fn: Callable[[], object],
        *,
        clock_name: str = "wall",
        warmup: int = 0,
        sync: Callable[[], None] | None = None,
    ) -> None:
        self.fn = fn
        self.sync = sync
        self.samples: list[float] = []
        self._clock = clock(clock_name)
        start = self._clock()
        for _ in range(warmup):
            fn()
        if sync is not None:
            sync()
        self.spent_s = self._clock() - start

    def run_until(self, stop: StopRule) -> list[float]:
        """Time runs until ``stop`` says so (checked before each run); all samples so far."""
        clk, fn, sync = self._clock, self.fn, self.sync
        while not stop(self.samples, self.spent_s):
            t0 = clk()
            fn()
            if sync is not None:
                sync()
            dt = clk() - t0
            self.samples.append(dt)
            self.spent_s += dt
        return self.samples


def time_runs(
    fn: Callable[[], object],
    *,
    repeat: int,
    warmup: int = 0,
    budget_s: float = math.inf,
    clock_name: str = "wall",
    sync: Callable[[], None] | None = None,
) -> list[float]:
    """Seconds of ``repeat`` runs of ``fn`` after ``warmup``, fewer (at least one) once the
    timed runs have spent ``budget_s``."""

    def stop(samples: list[float], _spent_s: float) -> bool:
        return len(samples) >= max(1, repeat) or (bool(samples) and sum(samples) >= budget_s)

    return Runs(fn, clock_name=clock_name, warmup=warmup, sync=sync).run_until(stop)
