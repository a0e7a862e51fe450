"""Cut points, decomposition, deduplication and reassembly of bricks."""

from __future__ import annotations

import math
import resource
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.evaluation import graphs
from trims.errors import ValidationError
from trims.evaluation import bricks, generator, graph, ir, ort_backend, submodel, zoo
from trims.evaluation.db import ResultsDB
from trims.evaluation.measure import Measurement, MeasureSettings


def _ir(model: onnx.ModelProto, name: str) -> ir.ModelIR:
    return ir.build(graph.prepare(model, name, 1), name, 1)


def test_cut_points_fall_between_residual_blocks() -> None:
    m = _ir(graphs.residual(blocks=2), "res")
    # layers: 0 stem | 1..4 block 0 | 5 relu | 6..9 block 1 | 10 relu | 11 gap;
    # inside a block the skip connection is live too, so there is no cut, and the block's
    # second conv, the residual add and the relu after it are one fused kernel: no cut at 4, 9
    assert bricks.fused_kernels(m) == [[1, 2], [3, 4, 5], [6, 7], [8, 9, 10]]
    assert bricks.cut_points(m) == [0, 5, 10]
    assert bricks.segments(m) == [[0], [1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11]]


def test_a_conv_and_the_activation_it_fuses_are_one_brick() -> None:
    m = _ir(graphs.conv_gemm(), "cg")
    assert [layer.op_type for layer in m.layers] == ["Conv", "Relu", "MaxPool", "Flatten", "Gemm"]
    # ONNX Runtime runs Conv + Relu as one kernel: timing them apart times work it never does
    assert [b.indices for b in bricks.decompose(m, 1)] == [(0, 1), (2,), (3,), (4,)]


def test_granularity_groups_segments() -> None:
    m = _ir(graphs.residual(blocks=2), "res")
    assert [b.indices for b in bricks.decompose(m, 1)] == [
        (0,),
        (1, 2, 3, 4, 5),
        (6, 7, 8, 9, 10),
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
    # stem, residual block (twice), pooling
    assert len({p.signature for p in parts}) == 3
    # four bricks: 2 + 3 * 1 ms, each paid 0.1 ms of fixed cost the whole model pays once
    assert bricks.reconstruct(parts, times, 0.1) == pytest.approx(5.0 - 3 * 0.1)
    # less the layout conversions the bricks did at their boundaries
    assert bricks.reconstruct(parts, times, 0.1, layout_ms=0.25) == pytest.approx(4.45)


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


def _measurement(ms: float, se_ms: float, reps: int = 100) -> Measurement:
    # std_error_ms = (spread / 1.349) / sqrt(reps): pick the spread that gives se_ms
    spread = se_ms * 1.349 * math.sqrt(reps)
    return Measurement(ms, ms, spread, ms, reps, 1.0)


def _trips(*pairs: tuple[str, tuple[int, ...]]) -> ort_backend.Conversions:
    return Counter(pairs)


IN, OUT = "ReorderInput", "ReorderOutput"


def test_round_trips_are_the_bricks_conversions_less_the_models() -> None:
    parts = [bricks.Brick("m", (i,), f"s{i}") for i in range(4)]
    a, b, c = (1, 8, 4, 4), (1, 16, 4, 4), (1, 24, 4, 4)
    conversions = {
        # the model converts a in, b around something in s1's middle, c out twice
        "model:m": _trips((IN, a), (OUT, b), (IN, b), (OUT, c), (OUT, c)),
        "s0": _trips((IN, a), (OUT, a)),  # a boundary: s0 converts out, s1 back in
        "s1": _trips((IN, a), (OUT, b), (IN, b)),  # b inside s1: the model does it too
        "s2": _trips(),
        "s3": _trips((OUT, c)),  # the model converts c once more than its bricks
    }
    trips = bricks.extra_conversions(parts, conversions)
    assert trips == {"reorder:1x8x4x4": 1.0, "reorder:1x24x4x4": -0.5}
    counts = bricks.terms(parts, conversions)
    # the round trips are taken away; 3 extra fixed costs are too, less the half the
    # conversion benchmark's runs paid themselves
    assert counts == {
        "s0": 1,
        "s1": 1,
        "s2": 1,
        "s3": 1,
        "reorder:1x8x4x4": -1.0,
        "reorder:1x24x4x4": 0.5,
        "empty": -2.5,
    }
    # a model not profiled (another framework), or one brick not: nothing is known
    assert (
        bricks.extra_conversions(parts, {k: v for k, v in conversions.items() if k != "s2"}) == {}
    )
    del conversions["model:m"]
    assert bricks.extra_conversions(parts, conversions) == {}
    assert bricks.terms(parts, conversions)["empty"] == -3


def test_estimate_carries_each_terms_uncertainty() -> None:
    parts = [bricks.Brick("m", (i,), sig) for i, sig in enumerate(["a", "b", "a"])]
    shape = (1, 8, 2, 2)
    each = _trips((IN, shape), (OUT, shape))
    conversions = {"a": each, "b": each, "model:m": _trips((IN, shape), (OUT, shape))}
    results = {
        "a": _measurement(4.0, 0.03),
        "b": _measurement(2.0, 0.04),
        "reorder:1x8x2x2": _measurement(0.1, 0.001),
        "empty": _measurement(0.01, 0.0005),
    }
    whole = _measurement(9.0, 0.05)
    est = bricks.estimate("m", parts, conversions, results, whole)
    # 4 + 2 + 4, less 2 fixed costs, less 2 round trips (each less the fixed cost its run paid)
    assert est.raw_ms == pytest.approx(10.0)
    assert est.overhead_ms == pytest.approx(2 * 0.01)
    assert est.layout_ms == pytest.approx(2 * (0.1 - 0.01))
    assert est.estimated_ms == pytest.approx(10.0 - 2 * 0.01 - 2 * 0.09)
    counts = bricks.terms(parts, conversions)
    assert est.estimated_ms == pytest.approx(
        sum(c * results[k].trimmed_mean_ms for k, c in counts.items())
    )
    # the empty model's coefficient: 2 extra runs less the 2 the round trips paid
    se = math.sqrt((2 * 0.03) ** 2 + 0.04**2 + (2 * 0.001) ** 2)
    assert est.estimated_se_ms == pytest.approx(se)
    assert est.correction_pct == pytest.approx(100 * 0.2 / 10.0)
    lo, hi = est.error_ci_pct
    assert lo < est.error_pct < hi
    ratio = est.estimated_ms / 9.0
    half = 1.959964 * ratio * math.hypot(se / est.estimated_ms, 0.05 / 9.0)
    assert hi - lo == pytest.approx(200 * half)
    # +8.9% with a 95% interval of about +-2%: it may be past the 10% line
    assert est.error_pct == pytest.approx(100 * (9.8 / 9.0 - 1))
    assert lo < 10.0 < hi and est.verdict() == "straddles"


def test_a_brick_below_its_weight_stream_floor_counts_the_stream_instead() -> None:
    # a convolution (10% of the weights) well above its floor, a classifier (90%) below it
    parts = [bricks.Brick("m", (i,), sig) for i, sig in enumerate(["conv", "fc"])]
    floors = bricks.Floors("stream:x", {"conv": 0.1, "fc": 0.9})
    results = {
        "conv": _measurement(5.0, 0.03),
        "fc": _measurement(6.0, 0.02),
        "stream:x": _measurement(10.0, 0.05),
        "empty": _measurement(0.01, 0.0005),
    }
    # one pass over all weights takes 10 - 0.01 ms: the classifier's 90% take 8.991 ms, more
    # than its 5.99 as a brick; the convolution's 10% take 0.999 ms, far less than its 4.99
    assert floors.binding(results) == {"fc": 0.9}
    counts = bricks.terms(parts, {}, floors, results)
    # the classifier counts as 0.9 of the stream plus 0.1 of a fixed cost; one fixed cost less
    assert counts == {"conv": 1, "stream:x": 0.9, "empty": pytest.approx(-0.9)}
    est = bricks.estimate("m", parts, {}, results, _measurement(14.0, 0.05), floors=floors)
    floor_fc = 0.01 + 0.9 * (10.0 - 0.01)
    assert est.floor_ms == pytest.approx(floor_fc - 6.0)
    assert est.estimated_ms == pytest.approx(5.0 + floor_fc - 0.01)
    assert est.estimated_ms == pytest.approx(
        sum(c * results[k].trimmed_mean_ms for k, c in counts.items())
    )
    se = math.sqrt(0.03**2 + (0.9 * 0.05) ** 2 + (0.9 * 0.0005) ** 2)
    assert est.estimated_se_ms == pytest.approx(se)
    # net, the corrections added: the floor raised more than the fixed cost took
    assert est.correction_pct == pytest.approx(100 * (0.01 - est.floor_ms) / 11.0)
    # a faster stream (a model whose weights stay cached) holds nothing up
    results["stream:x"] = _measurement(5.0, 0.05)
    assert floors.binding(results) == {}
    assert bricks.terms(parts, {}, floors, results) == {"conv": 1, "fc": 1, "empty": -1}
    # nothing is known before the stream is measured (another framework)
    del results["stream:x"]
    assert floors.binding(results) == {}


def _stream(m: ir.ModelIR) -> bricks.WeightStream | None:
    return bricks.weight_stream(m.name, submodel.weights(m))


def test_a_models_weight_stream_and_each_bricks_share_of_it() -> None:
    m = _ir(graphs.residual(blocks=2, channels=32), "res")
    stream = _stream(m)
    assert stream is not None
    # the blocks' convolution weights (32 x 32 x 3 x 3 floats), none of the small tensors
    # (biases, the 3-channel stem's 3.4 KiB)
    convs = [t.name for t in m.model.graph.initializer if t.dims[1:] == [32, 3, 3]]
    assert len(convs) == 4 and [name for name, _ in stream.tensors] == convs
    assert all(shape == (32, 288) for _, shape in stream.tensors)
    assert stream.nbytes == 4 * 32 * 288 * 4
    parts = bricks.decompose(m, 1)
    floors = bricks.floors(m, parts, stream)
    # each brick's share is its streamed weights' bytes; together, all of them
    per_brick = {
        b.signature: sum(name in convs for i in b.indices for name, _ in m.layers[i].params)
        for b in parts
    }
    assert floors.share == {sig: n / 4 for sig, n in per_brick.items() if n}
    assert sum(floors.share[b.signature] for b in parts if b.signature in floors.share) == (
        pytest.approx(1.0)
    )
    # the key names the shapes streamed, not the model: the same weights elsewhere share it
    again = _stream(_ir(graphs.residual(blocks=2, channels=32, name="other"), "o"))
    assert again is not None and again.key == stream.key and again.model == "o"
    wider = _stream(_ir(graphs.residual(blocks=2, channels=36), "w"))
    assert wider is not None and wider.key != stream.key
    # 27% more bytes: within a factor sqrt(2), the first stream measured stands for it, and
    # each brick's share is of the bytes that stream reads
    assert bricks.shared_stream(wider, [stream]) is stream
    w = _ir(graphs.residual(blocks=2, channels=36), "w")
    shared = bricks.floors(w, bricks.decompose(w, 1), wider, stream)
    assert shared.key == stream.key
    assert max(shared.share.values()) == pytest.approx(2 * 36 * 324 * 4 / stream.nbytes)
    far = _stream(_ir(graphs.residual(blocks=2, channels=48), "f"))
    assert far is not None and bricks.shared_stream(far, [stream]) is far
    # a model with no weight worth streaming has none
    assert _stream(_ir(graphs.conv_gemm(), "cg")) is None


def test_the_stream_model_multiplies_each_matrix_and_binds_the_given_arrays_in_place() -> None:
    rng = np.random.default_rng(0)
    w = [rng.standard_normal(shape).astype(np.float32) for shape in ((4, 6), (3, 5))]
    model = ort_backend.stream_model([(4, 6), (3, 5)])
    sess = ort_backend.session(model, ort_backend.OrtVariant("all", 1), "stream")
    x = [rng.standard_normal((1, k)).astype(np.float32) for k in (4, 3)]
    y = sess.run(None, {"x0": x[0], "w0": w[0], "x1": x[1], "w1": w[1]})
    for i in range(2):
        np.testing.assert_allclose(y[i], x[i] @ w[i], rtol=1e-5)
    # 64 MiB of weights: a runner bound to them in place faults none of their 16,384 pages in
    # again, where ORT's copy and prepacking of the same matrix as a constant fault twice that
    big = np.ones((4096, 4096), np.float32)

    def faults(model: onnx.ModelProto, weights: dict[str, np.ndarray]) -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        ort_backend.runner(model, ort_backend.OrtVariant("all", 1), "s", weights)()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    faults(ort_backend.stream_model([(4, 6)]), {"w0": w[0]})  # ORT's first-session set-up
    assert faults(ort_backend.stream_model([big.shape]), {"w0": big}) < 2048
    constant = ort_backend.stream_model([big.shape])
    graph = constant.graph
    del graph.input[1]
    weight = graph.initializer.add(name="w0", data_type=onnx.TensorProto.FLOAT, dims=big.shape)
    weight.data_location = onnx.TensorProto.EXTERNAL
    weight.external_data.add(key="location", value="out-of-band")
    assert faults(constant, {"w0": big}) > 16384


def test_a_study_measures_each_models_weight_stream_and_counts_its_cost(tmp_path: Path) -> None:
    m = _ir(graphs.residual(blocks=2, channels=32), "res")
    stream = _stream(m)
    assert stream is not None
    db = ResultsDB(str(tmp_path / "r.sqlite"))
    try:
        settings = MeasureSettings(min_reps=3, max_time_s=30.0, max_reps=10_000_000)
        bencher = generator.Bencher(db, "onnxruntime", "opt=all,threads=1", 1, settings)
        [found] = bricks.study([m], bencher, [1], lambda irs, _: irs, target_rel=0.05)
        stored = db.get(bencher.key("stream", stream.key))
        assert stored is not None and stored.reps >= 3 and stored.elapsed_s > 0
        # the stream's cost is part of the bricks' side, whether or not a floor held one up
        costs = [
            db.get(bencher.key("brick", sig))
            for sig in {b.signature for b in bricks.decompose(m, 1)}
        ]
        assert all(c is not None for c in costs)
        assert found.time_bricks_s >= stored.elapsed_s + sum(c.elapsed_s for c in costs if c)
        [est] = found.models
        assert est.estimated_ms == pytest.approx(
            est.raw_ms - est.overhead_ms - est.layout_ms + est.floor_ms
        )
    finally:
        db.close()


def test_verdict_says_straddles_when_the_interval_crosses_the_line() -> None:
    def make(measured: float, se: float) -> bricks.BrickEstimate:
        return bricks.BrickEstimate("m", measured, 10.0, 3, measured_se_ms=se, estimated_se_ms=0.0)

    assert make(10.0, 0.01).verdict() == "within"
    assert make(8.0, 0.01).verdict() == "outside"  # +25%
    assert make(9.09, 0.3).verdict() == "straddles"  # +10.0% +- 6.5%
    assert make(10.0, 0.01).error_ci_pct[0] < 0 < make(10.0, 0.01).error_ci_pct[1]


def test_profiled_runner_sees_the_conversions_at_a_bricks_ends() -> None:
    m = _ir(graphs.residual(blocks=3, channels=32), "res")
    weights = submodel.weights(m)
    middle = bricks.decompose(m, 1)[2]  # the second residual block: convs on both sides
    model = bricks.export(m, middle, frozenset(weights))
    run, found = ort_backend.profiled_runner(model, ort_backend.OrtVariant("all", 1), "b", weights)
    run()  # the profiled run is over: the session runs on unprofiled
    shape = (1, 32, 16, 16)
    assert found == {(IN, shape): 1, (OUT, shape): 1}
    _, plain = ort_backend.profiled_runner(
        model, ort_backend.OrtVariant("disable", 1), "b", weights
    )
    assert not plain


def _profiled_round_trips(name: str, m: ir.ModelIR, g: int) -> dict[str, float]:
    variant = ort_backend.OrtVariant("all", 1)
    weights = submodel.weights(m)
    found = {bricks.whole_key(name): ort_backend.profiled_runner(m.model, variant, name)[1]}
    parts = bricks.decompose(m, g)
    for brick in parts:
        model = bricks.export(m, brick, frozenset(weights))
        found[brick.signature] = ort_backend.profiled_runner(model, variant, "b", weights)[1]
    return bricks.extra_conversions(parts, found)


def test_a_residual_stack_cut_into_bricks_converts_at_every_boundary() -> None:
    m = _ir(graphs.residual(blocks=3, channels=32), "res")
    parts = bricks.decompose(m, 1)
    trips = _profiled_round_trips("res", m, 1)
    # stem, three blocks and the pooling head, all blocked in the whole model (which converts
    # only the pooled output): each of the four boundaries is a round trip the bricks make
    assert len(parts) == 5
    assert trips == {"reorder:1x32x16x16": 4.0}


def _boundary_shapes(m: ir.ModelIR, parts: list[bricks.Brick]) -> Counter[str]:
    """How many brick boundaries carry an activation of each shape (reorder_key)."""
    return Counter(
        bricks.reorder_key(tuple(m.layers[b.indices[-1]].output_shapes[0])) for b in parts[:-1]
    )


def test_shufflenets_bricks_convert_only_at_their_boundaries() -> None:
    # Which layers ONNX Runtime keeps in its blocked layout depends on the CPU (the block width
    # follows the vector unit: an AVX-512 machine kept ShuffleNet's stem blocked where an AVX2
    # one did not), so the extra round trips are not one fixed table. What holds on every CPU:
    # a brick cut can add at most one round trip where it cuts, on the activation it cuts;
    # the conversions ShuffleNet's units make around their depthwise convolution are the
    # model's own and never appear. Were they read as the bricks' (6% off the estimate once),
    # some would sit on shapes no cut carries (1x272x7x7, 1x112x56x56 on this kind of CPU).
    shufflenet = ir.model_ir(zoo.materialize("shufflenet"), "shufflenet")
    parts = bricks.decompose(shufflenet, 1)
    boundaries = _boundary_shapes(shufflenet, parts)
    trips = _profiled_round_trips("shufflenet", shufflenet, 1)
    for key, n in trips.items():
        assert 0 < n <= boundaries[key], (key, n, boundaries)


def test_conversions_a_brick_shares_with_the_whole_model_cancel() -> None:
    # ShuffleNet's units, as profiled: each brick converts in and out around its depthwise
    # convolution on its own input/output shape, and so does the whole model, once per unit.
    m = _ir(graphs.residual(blocks=1), "res")
    parts = bricks.decompose(m, 1)  # stem, block, head: three distinct bricks
    assert len({b.signature for b in parts}) == len(parts) == 3
    unit = Counter({("ReorderInput", (1, 8, 4, 4)): 1, ("ReorderOutput", (1, 8, 4, 4)): 1})
    found: dict[str, Counter[tuple[str, tuple[int, ...]]]] = {b.signature: unit for b in parts}
    found[bricks.whole_key("res")] = Counter({k: n * len(parts) for k, n in unit.items()})
    assert bricks.extra_conversions(parts, found) == {}
    # ... and a boundary the model keeps blocked, converted out and back in, is one round trip
    found[parts[0].signature] = unit + Counter({("ReorderOutput", (1, 8, 2, 2)): 1})
    found[parts[1].signature] = unit + Counter({("ReorderInput", (1, 8, 2, 2)): 1})
    assert bricks.extra_conversions(parts, found) == {"reorder:1x8x2x2": 1.0}


def test_the_conversion_benchmark_gives_back_its_input() -> None:
    model = ort_backend.reorder_model((1, 24, 5, 7))
    feeds = ort_backend.random_inputs(model, seed=3)
    sess = ort_backend.session(model, ort_backend.OrtVariant("all", 1), "reorder")
    np.testing.assert_array_equal(sess.run(None, feeds)[0], feeds["x"])
