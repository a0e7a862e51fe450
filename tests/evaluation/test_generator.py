"""Micro-benchmarks: unique layers, fusion chains, and the two framework backends agree."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from tests.evaluation import graphs
from trims.evaluation import generator, graph, ir, ort_backend
from trims.evaluation.measure import MeasureSettings, measure, trimmed_mean


def _ir(model: onnx.ModelProto, name: str) -> ir.ModelIR:
    return ir.build(graph.prepare(model, name), name)


def test_layer_benchmarks_are_unique_and_runnable() -> None:
    models = [_ir(graphs.residual(blocks=2), "a"), _ir(graphs.residual(blocks=3, name="b"), "b")]
    benches = generator.layer_benchmarks(models)
    assert len(benches) == 5
    for bench in benches:
        sub = bench.build()
        onnx.checker.check_model(sub)
        assert len(sub.graph.node) == 1
        run = ort_backend.runner(sub, ort_backend.OrtVariant("all", 1), bench.label)
        result = measure(run, MeasureSettings(warmup=1, min_reps=3, max_reps=3))
        assert result.reps == 3 and result.trimmed_mean_ms > 0


def test_fusion_chains_find_conv_bn_relu() -> None:
    m = ir.load_ir("shufflenet")
    chains = generator.fusion_chains(m)
    ops = {tuple(m.layers[i].op_type for i in c) for c in chains}
    assert ("Conv", "BatchNormalization", "Relu") in ops
    assert ("Conv", "BatchNormalization") in ops


def test_pytorch_interpreter_matches_onnx_runtime() -> None:
    pytest.importorskip("torch")
    from trims.evaluation import torch_backend

    cases = [
        (graphs.conv_gemm(), "cg"),
        (graphs.residual(2), "res"),
        (graphs.asymmetric_pools(), "pools"),
    ]
    for model, name in cases:
        prepared = graph.prepare(model, name)
        feeds = ort_backend.random_inputs(prepared, seed=3)
        want = ort_backend.run_outputs(prepared, feeds, name)
        got = torch_backend.run_outputs(prepared, feeds, name)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)


def test_pytorch_interpreter_runs_squeezenet() -> None:
    pytest.importorskip("torch")
    from trims.evaluation import torch_backend

    m = ir.load_ir("squeezenet")
    feeds = ort_backend.random_inputs(m.model, seed=0)
    want = ort_backend.run_outputs(m.model, feeds, "squeezenet")
    got = torch_backend.run_outputs(m.model, feeds, "squeezenet")
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-6)


def test_trimmed_mean_drops_the_extremes() -> None:
    assert trimmed_mean([100.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, -50.0]) == 4.5
    assert trimmed_mean([3.0]) == 3.0
