"""The timing harness: clocks, warm-up, stop rules, sync placement and the summary."""

from __future__ import annotations

import math
import statistics
import time

import numpy as np
import pytest

from trims import timing


def test_clocks_by_name() -> None:
    assert timing.clock("wall") is time.perf_counter
    assert timing.clock("thread") is time.thread_time
    with pytest.raises(ValueError, match="unknown clock 'cpu'; use one of wall, thread"):
        timing.clock("cpu")


def test_summary_matches_numpy_percentiles_and_the_notch_rule() -> None:
    samples = [0.010, 0.012, 0.011, 0.030, 0.009, 0.0105, 0.0115]
    s = timing.summarize(samples)
    q1, median, q3 = np.percentile(samples, [25, 50, 75])
    half = 1.57 * (q3 - q1) / math.sqrt(len(samples))
    assert s.runs == 7 and s.min_s == 0.009 and s.max_s == 0.030
    assert s.median_s == pytest.approx(median) == statistics.median(samples)
    assert s.iqr_s == pytest.approx(q3 - q1)
    assert (s.ci95_low_s, s.ci95_high_s) == pytest.approx((median - half, median + half))


def test_one_sample_has_a_zero_width_interval_and_none_is_refused() -> None:
    s = timing.summarize([0.5])
    assert (s.median_s, s.ci95_low_s, s.ci95_high_s, s.iqr_s) == (0.5, 0.5, 0.5, 0.0)
    with pytest.raises(ValueError, match="no samples"):
        timing.summarize([])


def test_warmup_runs_are_not_timed_and_sync_follows_each_run() -> None:
    events: list[str] = []
    samples = timing.time_runs(lambda: events.append("run"), repeat=3, warmup=2,
                               sync=lambda: events.append("sync"))  # fmt: skip
    assert len(samples) == 3
    assert events == ["run", "run", "sync"] + ["run", "sync"] * 3


def test_a_spent_budget_stops_early_but_after_one_run() -> None:
    calls: list[int] = []
    samples = timing.time_runs(lambda: calls.append(1), repeat=50, budget_s=0.0)
    assert len(samples) == len(calls) == 1


def test_runs_resume_in_rounds_and_count_warmup_in_spent_time() -> None:
    runs = timing.Runs(lambda: sum(range(1000)), clock_name="thread", warmup=1)
    warm = runs.spent_s
    assert len(runs.run_until(lambda s, _spent: len(s) >= 2)) == 2
    assert len(runs.run_until(lambda s, _spent: len(s) >= 5)) == 5
    assert runs.spent_s == pytest.approx(warm + sum(runs.samples))
