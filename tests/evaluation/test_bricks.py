"""Cut points, decomposition, deduplication and reassembly of bricks."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from tests.evaluation import graphs
from trims.errors import ValidationError
from trims.evaluation import bricks, generator, graph, ir, ort_backend, submodel


def _ir(model: onnx.ModelProto, name: str) -> ir.ModelIR:
    return ir.build(graph.prepare(model, name, 1), name, 1)


def test_cut_points_fall_between_residual_blocks() -> None:
    m = _ir(graphs.residual(blocks=2), "res")
    # layers: 0 stem | 1..4 block 0 | 5 relu | 6..9 block 1 | 10 relu | 11 gap;
    # inside a block the skip connection is live too, so there is no cut
    assert bricks.cut_points(m) == [0, 4, 5, 9, 10]
    assert bricks.segments(m) == [[0], [1, 2, 3, 4], [5], [6, 7, 8, 9], [10], [11]]


def test_granularity_groups_segments() -> None:
    m = _ir(graphs.residual(blocks=2), "res")
    assert [b.indices for b in bricks.decompose(m, 1)] == [
        (0,),
        (1, 2, 3, 4),
        (5,),
        (6, 7, 8, 9),
        (10,),
        (11,),
    ]
    # G=12 could hold everything, but a segment starting with a Conv starts a new brick
    assert [b.indices for b in bricks.decompose(m, 12)] == [
        (0,),
        (1, 2, 3, 4, 5),
        (6, 7, 8, 9, 10, 11),
    ]


def test_repeated_blocks_deduplicate_across_models() -> None:
    a = _ir(graphs.residual(blocks=3), "a")
    b = _ir(graphs.residual(blocks=4, name="b"), "b")
    per = {m.name: bricks.decompose(m, 5) for m in (a, b)}
    unique = bricks.unique_bricks(per)
    # stem, one residual block, gap
    assert len(unique) == 3
    assert sum(len(v) for v in per.values()) == 5 + 6


def test_sharing_is_whole_run_time_over_unique_brick_run_time() -> None:
    models = [bricks.BrickEstimate("a", 10.0, 9.0, 2), bricks.BrickEstimate("b", 30.0, 31.0, 4)]
    study = bricks.BrickStudy(1, models, 3, 6, 1.0, 0.5, unique_bricks_ms=16.0)
    assert study.sharing == pytest.approx(40.0 / 16.0)
    assert bricks.BrickStudy(1, models, 0, 0, 1.0, 0.0, unique_bricks_ms=0.0).sharing == np.inf


def test_bricks_reassemble_to_the_original_graph() -> None:
    for model, name in [(graphs.residual(blocks=3), "res"), (graphs.conv_gemm(), "cg")]:
        m = _ir(model, name)
        parts = bricks.decompose(m, 3)
        for part in parts:
            onnx.checker.check_model(bricks.export(m, part))
        composed = bricks.compose(m, parts)
        onnx.checker.check_model(composed)
        feeds = ort_backend.random_inputs(m.model, seed=7)
        want = ort_backend.run_outputs(m.model, feeds, name)
        got = ort_backend.run_outputs(composed, feeds, name)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)


def test_squeezenet_bricks_chain_and_reassemble() -> None:
    m = ir.load_ir("squeezenet")
    parts = bricks.decompose(m, 5)
    assert sorted(i for b in parts for i in b.indices) == list(range(len(m.layers)))
    for part in parts:
        exported = bricks.export(m, part)
        assert len(exported.graph.input) == 1 and len(exported.graph.output) == 1
    feeds = ort_backend.random_inputs(m.model, seed=1)
    want = ort_backend.run_outputs(m.model, feeds, "squeezenet")
    got = ort_backend.run_outputs(bricks.compose(m, parts), feeds, "squeezenet")
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-7)


def test_reconstruct_subtracts_per_run_overhead() -> None:
    m = _ir(graphs.residual(blocks=2), "res")
    parts = bricks.decompose(m, 1)
    times = {p.signature: 1.0 for p in parts}
    times[parts[0].signature] = 2.0
    # stem, residual block, relu, pooling
    assert len({p.signature for p in parts}) == 4
    # six bricks: 2 + 5 * 1 ms, each paid 0.1 ms of fixed cost the whole model pays once
    assert abs(bricks.reconstruct(parts, times, 0.1) - (7.0 - 6 * 0.1 + 0.1)) < 1e-9


def test_bricks_and_whole_model_with_out_of_band_weights_match_inline() -> None:
    m = _ir(graphs.residual(blocks=2, channels=32), "res")
    weights = submodel.weights(m)
    assert weights and all(a.nbytes >= submodel.EXTERNAL_MIN_BYTES for a in weights.values())
    for brick in bricks.decompose(m, 3):
        inline = bricks.export(m, brick)
        lean = bricks.export(m, brick, frozenset(weights))
        if set(weights) & {t.name for t in inline.graph.initializer}:
            assert lean.ByteSize() < inline.ByteSize()
        feeds = ort_backend.random_inputs(inline)
        want = ort_backend.session(inline, ort_backend.OrtVariant("all", 1), "inline").run(
            None, feeds
        )
        got = ort_backend.session(lean, ort_backend.OrtVariant("all", 1), "lean", weights).run(
            None, feeds
        )
        np.testing.assert_array_equal(got[0], want[0])
    whole = generator.model_benchmark(m, weights)
    feeds = ort_backend.random_inputs(m.model)
    want = ort_backend.run_outputs(m.model, feeds, "res")
    sess = ort_backend.session(whole.build(), ort_backend.OrtVariant("disable", 1), "res", weights)
    np.testing.assert_array_equal(sess.run(None, feeds)[0], want[0])


def test_out_of_band_weights_missing_is_a_clear_error() -> None:
    m = _ir(graphs.residual(blocks=1, channels=32), "res")
    lean = generator.model_benchmark(m, submodel.weights(m)).build()
    with pytest.raises(ValidationError, match="out of band"):
        ort_backend.session(lean, ort_backend.OrtVariant("all", 1), "res")
