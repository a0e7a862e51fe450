"""Critical path (parallel lower bound) on hand-made DAGs; layer times and whole models
measured to the bounds' precision (real ONNX Runtime, real SQLite results database)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.evaluation import graphs
from trims.evaluation import analyzer, generator, ir
from trims.evaluation.analyzer import critical_path
from trims.evaluation.db import ResultsDB
from trims.evaluation.measure import MeasureSettings


def test_chain_is_the_sum() -> None:
    assert critical_path([1.0, 2.0, 3.0], [[], [0], [1]]) == (6.0, [0, 1, 2])


def test_diamond_takes_the_longer_branch() -> None:
    #   0 -> 1 (5) -> 3
    #   0 -> 2 (2) -> 3
    length, path = critical_path([1.0, 5.0, 2.0, 1.0], [[], [0], [0], [1, 2]])
    assert length == 7.0
    assert path == [0, 1, 3]


def test_independent_branches_and_late_join() -> None:
    # two chains 0->1 (3+3) and 2->3->4 (1+1+1) joined at 5
    weights = [3.0, 3.0, 1.0, 1.0, 1.0, 0.5]
    preds = [[], [0], [], [2], [3], [1, 4]]
    length, path = critical_path(weights, preds)
    assert length == 6.5
    assert path == [0, 1, 5]
    assert length <= sum(weights)


def test_empty_graph() -> None:
    assert critical_path([], []) == (0.0, [])


def test_rejects_non_topological_order() -> None:
    with pytest.raises(ValueError, match="topological"):
        critical_path([1.0, 1.0], [[1], []])


def test_precise_times_measure_each_model_and_its_bound_to_the_precision(tmp_path: Path) -> None:
    irs = [ir.model_ir(graphs.residual(2), "res"), ir.model_ir(graphs.conv_gemm(), "cg")]
    db = ResultsDB(str(tmp_path / "r.sqlite"))
    try:
        settings = MeasureSettings(min_reps=3, max_time_s=30.0, max_reps=100_000)
        benchers = [
            generator.Bencher(db, "onnxruntime", v, 1, settings)
            for v in ("opt=all,threads=1", "opt=extended,threads=1")
        ]
        target = 0.01
        times, wholes = analyzer.precise_times(irs, benchers, target)
        assert set(wholes) == {"res", "cg"} and not times.imprecise
        assert set(times.overhead) == {b.variant for b in benchers}
        for model in irs:
            whole = wholes[model.name]
            assert whole.std_error_ms <= target * whole.trimmed_mean_ms
            got = analyzer.bound(model, "onnxruntime", whole, times)
            assert got.precise and got.measured_se_ms == whole.std_error_ms
            # the bound under each variant was asked for the precision; the best-of mixes them,
            # so allow what mixing two variants' budgets can add
            assert 0 < got.sequential_lb_se_ms <= math.sqrt(2) * target * got.sequential_lb_ms
            assert got.sequential_lb_ms == pytest.approx(sum(t.best_ms for t in got.layers))
        # everything is in the database now: a second analysis measures nothing new
        again, wholes_again = analyzer.precise_times(irs, benchers, target)
        assert wholes_again == wholes and again.best == times.best
    finally:
        db.close()
