"""Precision-driven rounds over real ONNX Runtime benchmarks and a real SQLite results database."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.evaluation import graphs
from trims.evaluation import generator, ir, ort_backend
from trims.evaluation.db import ResultsDB
from trims.evaluation.measure import Measurement, MeasureSettings
from trims.evaluation.rounds import Rounds, budgets, runs_wanted


@pytest.fixture
def db(tmp_path: Path) -> Iterator[ResultsDB]:
    out = ResultsDB(str(tmp_path / "r.sqlite"))
    yield out
    out.close()


def _bencher(db: ResultsDB, max_reps: int = 200) -> generator.Bencher:
    measure = MeasureSettings(min_reps=3, max_reps=max_reps, max_time_s=30.0)
    return generator.Bencher(db, "onnxruntime", "opt=all,threads=1", 1, measure)


def _benchmarks() -> dict[str, generator.Benchmark]:
    model = ir.model_ir(graphs.conv_gemm(), "cg")
    empty = generator.Benchmark("overhead", "empty", "empty model", ort_backend.empty_model)
    return {"model": generator.model_benchmark(model), "empty": empty}


def test_every_term_is_measured_to_its_goal_and_no_further_than_a_slice(db: ResultsDB) -> None:
    # no run cap (as the analyses have none where the precision decides): a busy machine may
    # need thousands of runs of this 10 us model for +-0.5%, and the 30 s guard allows them
    bencher = _bencher(db, max_reps=1_000_000)
    state = Rounds()
    for key, bench in _benchmarks().items():
        state.open(key, bench, bencher)
    assert all(len(t.sampler.samples) == 3 for t in state.terms.values() if t.sampler)
    model = state.terms["model"].current().trimmed_mean_ms
    goals = {"model": 0.005 * model, "empty": math.inf}  # the empty model asks nothing more
    state.run(lambda: goals)
    measured = state.terms["model"].current()
    assert measured.std_error_ms <= goals["model"] and not state.imprecise
    assert state.terms["empty"].current().reps == 3
    state.close()
    assert db.get(bencher.key("model", _benchmarks()["model"].signature)) == measured


def test_a_stored_term_asked_for_more_is_measured_again_and_both_costs_count(
    db: ResultsDB,
) -> None:
    bencher = _bencher(db)
    first = Rounds()
    bench = _benchmarks()["model"]
    first.open("model", bench, bencher)
    first.close()
    stored = first.result("model")
    again = Rounds()
    again.open("model", bench, bencher)
    assert again.terms["model"].sampler is None  # from the database
    goal = stored.std_error_ms / 4
    again.run(lambda: {"model": goal})
    now = again.terms["model"].current()
    assert now.std_error_ms <= goal
    assert now.elapsed_s > stored.elapsed_s  # the first measurement's cost is counted too


def test_a_term_out_of_budget_stops_and_is_marked_imprecise(db: ResultsDB) -> None:
    bencher = _bencher(db, max_reps=5)
    state = Rounds()
    state.open("empty", _benchmarks()["empty"], bencher)
    state.run(lambda: {"empty": 0.0})  # a goal no run count reaches
    assert state.imprecise == {"empty"}
    assert state.terms["empty"].current().reps == 5
    # closed, then asked again (as a later model would): it is not opened again for nothing
    state.close()
    later = Rounds()
    later.open("empty", _benchmarks()["empty"], bencher)  # from the database
    later.run(lambda: {"empty": 0.0})
    assert later.imprecise == {"empty"} and later.terms["empty"].sampler is None


def test_a_closed_term_short_of_a_looser_goal_is_measured_again(db: ResultsDB) -> None:
    # a term asked a tight goal by one model may stop short of it when the goal loosens (one
    # slice of runs, then nothing more asked); a later model asking a looser goal than that
    # first one, but tighter than where the term stands, has it measured again
    bencher = _bencher(db, max_reps=1_000_000)
    state = Rounds()
    state.open("model", _benchmarks()["model"], bencher)
    # +-0.01%: a million runs or so; one 20 ms slice of runs is far from it
    tight = 1e-4 * state.terms["model"].current().trimmed_mean_ms
    asked = iter([{"model": tight}])
    state.run(lambda: next(asked, {"model": math.inf}))
    state.close()
    stood = state.result("model").std_error_ms
    assert stood > tight
    state.run(lambda: {"model": 0.9 * stood})
    assert not state.imprecise
    assert state.terms["model"].current().std_error_ms <= 0.9 * stood


def test_budgets_split_the_precision_among_independent_terms() -> None:
    counts = {"a": 2, "b": 1, "empty": 4}
    got = budgets(counts, 10.0, 0.01)
    # c_k * s_k equal for every term, and sum of (c_k s_k)^2 = (0.01 * 10)^2
    assert {k: got[k] * counts[k] for k in counts} == pytest.approx(
        dict.fromkeys(counts, 0.1 / math.sqrt(3))
    )
    assert sum((got[k] * counts[k]) ** 2 for k in counts) == pytest.approx(0.01)


def test_a_round_takes_the_missing_runs_at_most_a_slice() -> None:
    m = Measurement(1.0, 1.0, spread_ms=0.1349, min_ms=0.9, reps=10, elapsed_s=0.01)
    # halving the standard error needs 4x the runs (30 more); a 20 ms slice holds 20 of 1 ms
    assert runs_wanted(m, m.std_error_ms / 2) == 20
    assert runs_wanted(m, m.std_error_ms / 1.1) == math.ceil(10 * (1.1**2 - 1))
    assert runs_wanted(m, m.std_error_ms * 2) == 1
