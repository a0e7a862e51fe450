"""Stopping rules on synthetic samples: the precision budget of bricks and whole models."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from tests.evaluation import graphs
from trims.evaluation import bricks, graph, ir
from trims.evaluation.measure import (
    MeasureSettings,
    Precision,
    Sampler,
    Stop,
    std_error,
    stop_after,
    summarize,
)

SETTINGS = MeasureSettings(warmup=0, min_reps=3, max_reps=200, max_time_s=math.inf)


def _runs(samples_s: list[float], enough: Stop, settings: MeasureSettings = SETTINGS) -> int:
    """How many of ``samples_s`` the stopping rule takes before it stops."""
    for n in range(len(samples_s) + 1):
        if stop_after(samples_s[:n], sum(samples_s[:n]), settings, enough):
            return n
    raise AssertionError("the rule never stopped on these samples")


def _noisy(mean_ms: float, rel_sd: float, n: int = 200, seed: int = 0) -> list[float]:
    """Per-run seconds around ``mean_ms`` with relative standard deviation ``rel_sd``."""
    rng = np.random.default_rng(seed)
    return list(np.abs(rng.normal(mean_ms, rel_sd * mean_ms, n)) / 1e3)


def _brick_budgets(
    parts: list[bricks.Brick], times: dict[str, float], overhead_ms: float, target_rel: float
) -> dict[str, float]:
    """The budgets of a model's unique bricks, its estimate from those times."""
    counts = Counter(p.signature for p in parts)
    return bricks.budgets(counts, bricks.reconstruct(parts, times, overhead_ms), target_rel)


def test_small_share_brick_stops_earlier_than_a_large_one() -> None:
    model = ir.build(graph.prepare(graphs.residual(blocks=1), "m", 1), "m", 1)
    parts = bricks.decompose(model, 1)
    # one brick carries almost all of the model's time; the others are 0.2 ms each
    big = parts[1].signature
    times = {p.signature: 0.2 for p in parts}
    times[big] = 20.0
    tol = _brick_budgets(parts, times, overhead_ms=0.0, target_rel=0.02)
    small = next(s for s in tol if s != big)
    # both are equally noisy relative to their own time (20% of it)
    big_runs = _runs(_noisy(20.0, 0.2, seed=1), Precision(abs_ms=tol[big]).met)
    small_runs = _runs(_noisy(0.2, 0.2, seed=2), Precision(abs_ms=tol[small]).met)
    same_relative = _runs(_noisy(0.2, 0.2, seed=2), Precision(rel=0.02).met)
    assert small_runs == SETTINGS.min_reps
    assert small_runs < big_runs
    assert small_runs < same_relative


def test_never_stops_below_the_minimum_runs() -> None:
    constant = [1e-3] * 50
    loose = Precision(rel=10.0, abs_ms=1e6).met
    assert _runs(constant, loose) == SETTINGS.min_reps
    assert _runs(_noisy(5.0, 0.3), loose) == SETTINGS.min_reps
    strict = MeasureSettings(warmup=0, min_reps=9, max_reps=200, max_time_s=math.inf)
    assert _runs(constant, loose, strict) == 9


def test_whole_model_rule_is_relative_to_its_own_time() -> None:
    quiet = _runs(_noisy(40.0, 0.01, seed=3), Precision(rel=0.02).met)
    noisy = _runs(_noisy(40.0, 0.2, seed=3), Precision(rel=0.02).met)
    assert quiet == SETTINGS.min_reps
    assert noisy > quiet
    # the same samples scaled by 100x need exactly as many runs: the rule is scale-free
    scaled = [s * 100 for s in _noisy(40.0, 0.2, seed=3)]
    assert _runs(scaled, Precision(rel=0.02).met) == noisy


def _never(_: list[float]) -> bool:
    return False


def test_time_and_run_caps_still_stop_a_noisy_benchmark() -> None:
    samples = _noisy(1.0, 0.5, seed=4)
    capped = MeasureSettings(warmup=0, min_reps=3, max_reps=20, max_time_s=math.inf)
    assert _runs(samples, _never, capped) == 20
    timed = MeasureSettings(warmup=0, min_reps=3, max_reps=200, max_time_s=0.01)
    n = _runs(samples, _never, timed)
    assert sum(samples[: n - 1]) < 0.01 <= sum(samples[:n])


def test_budgets_split_the_models_error_budget() -> None:
    model = ir.build(graph.prepare(graphs.residual(blocks=3), "r", 1), "r", 1)
    parts = bricks.decompose(model, 1)
    times = {p.signature: 1.0 + 0.5 * k for k, p in enumerate(parts)}
    tol = _brick_budgets(parts, times, overhead_ms=0.01, target_rel=0.05)
    counts = {s: sum(p.signature == s for p in parts) for s in tol}
    assert max(counts.values()) == 3  # the repeated residual block
    estimate = bricks.reconstruct(parts, times, 0.01)
    # a brick that occurs c times carries c times its error: the budget is per occurrence...
    assert len({round(tol[s] * counts[s], 12) for s in tol}) == 1
    # ...and the errors add in quadrature to exactly the model's target
    total = math.sqrt(sum((counts[s] * tol[s]) ** 2 for s in tol))
    assert math.isclose(total, 0.05 * estimate)


def test_stored_standard_error_matches_the_samples() -> None:
    samples = _noisy(3.0, 0.1, n=15, seed=5)
    m = summarize(samples, elapsed_s=sum(samples))
    assert math.isclose(m.std_error_ms, std_error(samples) * 1e3)


def test_sampler_counts_setup_and_resumes() -> None:
    calls: list[int] = []
    settings = MeasureSettings(warmup=2, min_reps=3, max_reps=200, max_time_s=math.inf)
    sampler = Sampler(lambda: calls.append(1), settings, setup_s=5.0)
    assert len(calls) == 2  # warm-up only
    pilot = sampler.run(lambda _: True)
    assert pilot.reps == 3 and len(calls) == 5
    more = sampler.run(lambda xs: len(xs) >= 6)
    assert more.reps == 6 and len(calls) == 8
    assert more.elapsed_s >= 5.0 and sampler.elapsed_s == more.elapsed_s


def test_sampler_runs_more_in_rounds_until_its_budget_is_spent() -> None:
    calls: list[int] = []
    settings = MeasureSettings(warmup=1, min_reps=3, max_reps=10, max_time_s=math.inf)
    sampler = Sampler(lambda: calls.append(1), settings)
    sampler.run_more(4)
    assert len(sampler.samples) == 4 and not sampler.capped
    sampler.run_more(4)
    assert len(sampler.samples) == 8
    sampler.run_more(4)  # the run budget (10) stops the round early
    assert len(sampler.samples) == 10 and sampler.capped and len(calls) == 11
    sampler.run_more(4)
    assert len(sampler.samples) == 10


def test_a_round_after_another_samplers_runs_starts_with_an_untimed_run() -> None:
    calls = {"a": 0, "b": 0}
    settings = MeasureSettings(warmup=1, min_reps=1, max_reps=100, max_time_s=math.inf)

    def bump(key: str) -> None:
        calls[key] += 1

    a = Sampler(lambda: bump("a"), settings)
    b = Sampler(lambda: bump("b"), settings)
    b.run_more(2)  # b was made last: no re-warm
    assert calls["b"] == 1 + 2 and b.rewarm_s == 0.0
    a.run_more(2)  # b ran since a was made: one untimed run first
    assert calls["a"] == 1 + 1 + 2 and len(a.samples) == 2
    a.run_more(2)  # a ran last: straight on
    assert calls["a"] == 1 + 1 + 4 and len(a.samples) == 4
    b.run_more(1)
    assert calls["b"] == 1 + 2 + 1 + 1 and len(b.samples) == 3
    # the re-warm runs are kept apart from the benchmark's own cost
    assert a.rewarm_s > 0.0
    assert math.isclose(a.elapsed_s, a.setup_s + a._runs.spent_s)


def test_a_sampler_whose_setup_spent_the_time_budget_still_times_its_minimum_runs() -> None:
    # a whole model whose session took longer than the budget (squeezenet under a 0.05 s
    # budget on a slow day) had no runs, and summarizing it failed
    settings = MeasureSettings(warmup=1, min_reps=3, max_reps=100, max_time_s=0.05)
    sampler = Sampler(lambda: None, settings, setup_s=0.2)
    assert not sampler.capped
    sampler.run_more(3)
    assert len(sampler.samples) == 3 and sampler.capped
    sampler.run_more(3)
    assert len(sampler.samples) == 3 and sampler.measurement().reps == 3


def test_a_capped_sampler_is_not_rewarmed() -> None:
    calls: list[int] = []
    settings = MeasureSettings(warmup=0, min_reps=1, max_reps=2, max_time_s=math.inf)
    a = Sampler(lambda: calls.append(1), settings)
    a.run_more(5)
    assert len(calls) == 2 and a.capped
    Sampler(lambda: None, settings).run_more(1)
    a.run_more(1)
    assert len(calls) == 2
