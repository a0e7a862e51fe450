"""Critical path (parallel lower bound) on hand-made DAGs; layer times and whole models
measured to the bounds' precision (real ONNX Runtime, real SQLite results database)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.evaluation import graphs
from trims.evaluation import analyzer, generator, ir, submodel
from trims.evaluation.analyzer import critical_path
from trims.evaluation.db import ResultsDB
from trims.evaluation.measure import Measurement, MeasureSettings


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
        # no run cap that matters, as in the analyses: on a busy machine (or under coverage)
        # an empty model subtracted from every layer may need more than 100,000 of its 3 us runs
        settings = MeasureSettings(min_reps=3, max_time_s=30.0, max_reps=10_000_000)
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
        # a second analysis on the same database takes the whole models from it (each one's
        # goal depends on its own time only); a layer is measured again only where its goal
        # moved past it (its budget is a share of the bound, which moves when a later model
        # re-measures a shared term, the empty model)
        again, wholes_again = analyzer.precise_times(irs, benchers, target)
        assert wholes_again == wholes and not again.imprecise
        assert again.best.keys() == times.best.keys()
    finally:
        db.close()


def _measured(ms: float, se: float) -> Measurement:
    """A stored measurement of ``ms`` whose standard error is ``se`` (one run, that spread)."""
    return Measurement(ms, ms, spread_ms=se * 1.349, min_ms=ms, reps=1, elapsed_s=0.0)


def test_every_bound_carries_its_standard_error() -> None:
    # Conv, Relu, MaxPool, Flatten, Gemm: one chain (the layers 0 and 1), every layer unique
    model = ir.model_ir(graphs.conv_gemm(), "cg")
    ms, se = [1.0, 0.5, 0.2, 0.1, 2.0], [0.1, 0.2, 0.05, 0.05, 0.3]
    sigs = [layer.signature for layer in model.layers]
    times = analyzer.LayerTimes(
        best={s: (t, "v") for s, t in zip(sigs, ms, strict=True)},
        se_ms=dict(zip(sigs, se, strict=True)),
        overhead={"v": _measured(0.003, 0.01)},
    )
    whole = _measured(4.0, 0.02)
    plain = analyzer.bound(model, "onnxruntime", whole, times)
    # five independent layers, one empty model subtracted five times
    sequential = math.sqrt(sum(x * x for x in se) + (5 * 0.01) ** 2)
    assert plain.sequential_lb_se_ms == pytest.approx(sequential)
    # a chain of layers: the critical path is every layer
    assert plain.parallel_lb_se_ms == pytest.approx(sequential)
    # no chain measured: the fused bounds are the plain ones, errors included
    assert plain.fused_sequential_lb_se_ms == pytest.approx(sequential)

    (chain,) = generator.fusion_chains(model)
    fused = analyzer.FusionResult(
        submodel.group_signature(model, chain), "Conv+Relu", 1.2, 1.5,
        fused_se_ms=0.15, variant="v", overhead_se_ms=0.01,
    )  # fmt: skip
    got = analyzer.bound(model, "onnxruntime", whole, times, {fused.signature: fused})
    assert got.fused_sequential_lb_ms == pytest.approx(3.5)
    # the chain's measurement stands for its two layers; the empty model, one measurement,
    # is subtracted four times now
    fused_se = math.sqrt(0.15**2 + 0.05**2 + 0.05**2 + 0.3**2 + (4 * 0.01) ** 2)
    assert got.fused_sequential_lb_se_ms == pytest.approx(fused_se)
    assert got.fused_parallel_lb_se_ms == pytest.approx(fused_se)
    assert got.sequential_lb_se_ms == pytest.approx(sequential)  # the plain bound unchanged
    # a chain slower than its layers one by one is not used, nor is its error
    slower = analyzer.FusionResult(fused.signature, "Conv+Relu", 1.6, 1.5, fused_se_ms=0.15)
    got = analyzer.bound(model, "onnxruntime", whole, times, {slower.signature: slower})
    assert got.fused_sequential_lb_se_ms == pytest.approx(sequential)


def test_a_layer_met_twice_counts_its_error_twice() -> None:
    # two identical residual blocks: each of their layers is one measurement used twice
    model = ir.model_ir(graphs.residual(2), "res")
    counts: dict[str, int] = {}
    for layer in model.layers:
        counts[layer.signature] = counts.get(layer.signature, 0) + 1
    twice = next(s for s, c in counts.items() if c == 2)
    times = analyzer.LayerTimes(
        best={s: (1.0, "v") for s in counts},
        se_ms={s: (0.1 if s == twice else 0.0) for s in counts},
        overhead={"v": _measured(0.003, 0.0)},
    )
    got = analyzer.bound(model, "onnxruntime", _measured(9.0, 0.01), times)
    # the same error twice adds up, not in quadrature (0.2, not 0.141)
    assert got.sequential_lb_se_ms == pytest.approx(0.2)
