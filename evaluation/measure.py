"""Timing: warm up, repeat until the estimate is stable or a time budget is spent, summarize.

The runs, the clocks and the median's confidence interval are :mod:`trims.timing`'s; this
module adds the stopping rules and the trimmed mean the evaluation's benchmarks report.

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
waiting for a core. Use ``clock="wall"`` for multi-threaded variants (see :mod:`trims.timing`).

A second stopping rule, :class:`Precision`, asks for an absolute or relative bound on the
standard error of the estimate (see :func:`std_error`) of one benchmark run on its own. The
bricks study applies the same bound across benchmarks: it gives each the standard error its use
needs (:func:`trims.evaluation.rounds.budgets`) and measures them in rounds, each a
:class:`Sampler` kept open between rounds (:meth:`Sampler.run_more`), so a brick takes a few
pilot runs, waits until its model's other bricks have theirs, then continues to its budget.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from trims import timing


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
    #: "thread" (CPU time of the calling thread) or "wall" (perf_counter); see trims.timing
    clock: str = "thread"

    def timer(self) -> Callable[[], float]:
        """The clock function per :attr:`clock`."""
        return timing.clock(self.clock)


@dataclass(frozen=True)
class Measurement:
    """Summary of one benchmark, in milliseconds."""

    trimmed_mean_ms: float
    median_ms: float
    spread_ms: float
    min_ms: float
    reps: int
    elapsed_s: float

    @property
    def std_error_ms(self) -> float:
        """Standard error of the estimate, from the stored IQR and run count (:func:`std_error`)."""
        return _IQR_TO_SD * self.spread_ms / math.sqrt(self.reps)


#: a normal distribution's standard deviation per unit of interquartile range (1 / 1.349)
_IQR_TO_SD = 1.0 / 1.349
#: the normal quantile of a two-sided 95% confidence interval
Z95 = 1.959964


def std_error(samples: list[float] | np.ndarray) -> float:
    """Robust standard error of a location estimate: (IQR / 1.349) / sqrt(n).

    The IQR, not the standard deviation, estimates the spread, so one preempted run does not
    inflate it; the same formula applied to a stored :class:`Measurement` (its ``spread_ms`` and
    ``reps``) gives :attr:`Measurement.std_error_ms`, so a database row can be judged against
    a new precision requirement without its samples.
    """
    q1, q3 = np.percentile(np.asarray(samples, dtype=np.float64), [25, 75])
    return float(_IQR_TO_SD * (q3 - q1) / math.sqrt(len(samples)))


@dataclass(frozen=True)
class Precision:
    """Stop once the standard error is below ``rel`` of the trimmed mean or ``abs_ms``."""

    rel: float = 0.0
    abs_ms: float = 0.0
    trim: float = 0.2

    def met(self, samples_s: list[float]) -> bool:
        """Whether the per-run seconds in ``samples_s`` already meet this precision."""
        bound_s = max(self.rel * trimmed_mean(samples_s, self.trim), self.abs_ms / 1e3)
        return std_error(samples_s) <= bound_s


def trimmed_mean(samples: list[float] | np.ndarray, trim: float = 0.2) -> float:
    """Mean of the samples after dropping ``trim`` of them at each end."""
    values = np.sort(np.asarray(samples, dtype=np.float64))
    if values.size == 0:
        raise ValueError("trimmed_mean of no samples")
    cut = math.floor(values.size * trim)
    kept = values[cut : values.size - cut] if values.size - 2 * cut > 0 else values
    return float(kept.mean())


def stable(samples: list[float], rel_tol: float, abs_tol_s: float) -> bool:
    """The notch rule: the median's 95% confidence half-width is within tolerance."""
    half_width = timing.median_ci_half_width(samples)
    return half_width <= max(rel_tol * statistics.median(samples), abs_tol_s)


def summarize(samples_s: list[float], elapsed_s: float, trim: float = 0.2) -> Measurement:
    """Turn per-run seconds into a :class:`Measurement`."""
    s = timing.summarize(samples_s)
    return Measurement(
        trimmed_mean_ms=trimmed_mean(samples_s, trim) * 1e3,
        median_ms=s.median_s * 1e3,
        spread_ms=s.iqr_s * 1e3,
        min_ms=s.min_s * 1e3,
        reps=s.runs,
        elapsed_s=elapsed_s,
    )


#: a stopping criterion on the per-run seconds so far
Stop = Callable[[list[float]], bool]


def stop_after(
    samples_s: list[float], elapsed_s: float, settings: MeasureSettings, enough: Stop
) -> bool:
    """The stopping rule: never below ``min_reps``; then ``enough``, the time or run budget."""
    if len(samples_s) < settings.min_reps:
        return False
    return (
        len(samples_s) >= settings.max_reps or elapsed_s >= settings.max_time_s or enough(samples_s)
    )


class Sampler:
    """One open benchmark: warmed up once, timed in rounds until a criterion is met.

    ``elapsed_s`` counts ``setup_s`` (what it cost to get ``fn``: export, session creation)
    plus the warm-up and every timed run, on the measurement clock, and nothing done between
    rounds; the runs that re-warm it between rounds are ``rewarm_s``, apart.

    Note [re-warm between rounds]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Rounds interleave benchmarks (the bricks study), so the first run of a round follows
    another benchmark's runs: its weights, buffers and code are no longer in the caches, and a
    20 ms model timed one run per round was timed cold every time, while a 50 us brick timed
    many runs per round was timed mostly warm: the whole model came out slower than its parts
    by an amount that changed with how the runs fell into rounds (SqueezeNet -9.5% before,
    -3.6% after, in back-to-back runs of the zoo study). So a round starts with one untimed
    run when another sampler ran since: every timed run follows a run of its own benchmark, as
    it would measured alone. Those runs are the price of interleaving, which a benchmark
    measured on its own does not pay, so they count on neither side of a benchmarking-time
    comparison.
    """

    #: the sampler whose runs this process timed last (:meth:`run_more` re-warms after another)
    _last: Sampler | None = None

    def __init__(self, fn: Callable[[], object], settings: MeasureSettings, setup_s: float = 0.0):
        self.settings = settings
        self._runs = timing.Runs(fn, clock_name=settings.clock, warmup=settings.warmup)
        self.setup_s = setup_s
        #: clock seconds of the untimed runs that re-warmed it between rounds (not in elapsed)
        self.rewarm_s = 0.0
        Sampler._last = self

    @property
    def samples(self) -> list[float]:
        return self._runs.samples

    @property
    def elapsed_s(self) -> float:
        return self.setup_s + self._runs.spent_s

    @property
    def capped(self) -> bool:
        """Whether the run or time budget (:class:`MeasureSettings`) is spent; the time budget
        only once ``min_reps`` runs are timed (a session whose creation alone took the budget
        still gets them: a measurement needs runs)."""
        s, n = self.settings, len(self.samples)
        return n >= s.max_reps or (n >= s.min_reps and self.elapsed_s >= s.max_time_s)

    def run_more(self, runs: int) -> None:
        """Time ``runs`` more runs (fewer if the run or time budget runs out first).

        When another sampler ran since this one's last run, one untimed run comes first (Note
        [re-warm between rounds]).
        """
        if self.capped:
            return
        if Sampler._last is not self:
            clock = self.settings.timer()
            start = clock()
            self._runs.fn()
            self.rewarm_s += clock() - start
            Sampler._last = self
        target = len(self.samples) + runs
        self._runs.run_until(lambda samples, _spent: len(samples) >= target or self.capped)

    def run(self, enough: Stop) -> Measurement:
        """Time more runs until :func:`stop_after` says stop; summarize all runs so far."""
        self._runs.run_until(
            lambda samples, spent: stop_after(samples, spent, self.settings, enough)
        )
        return self.measurement()

    def measurement(self) -> Measurement:
        return summarize(self.samples, self.elapsed_s, self.settings.trim)


def measure(fn: Callable[[], object], settings: MeasureSettings | None = None) -> Measurement:
    """Time ``fn`` per :class:`MeasureSettings`; ``elapsed_s`` (same clock) includes warm-up."""
    s = settings or MeasureSettings()
    return Sampler(fn, s).run(lambda samples: stable(samples, s.rel_tol, s.abs_tol_ms / 1e3))
