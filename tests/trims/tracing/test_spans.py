"""Spans and traces: ids, round trips, nesting by containment and by correlation, walks."""

from __future__ import annotations

import pytest

from trims.tracing.levels import Level
from trims.tracing.spans import Span, Trace, nest, new_span_id, new_trace_id

P = "worker 1"


def span(
    name: str, level: Level, start: int, end: int, thread: str = "main", **attrs: object
) -> Span:
    return Span(name, level, start, end, (P, thread), attributes=attrs)  # type: ignore[arg-type]


def test_ids_are_w3c_hex() -> None:
    t, s = new_trace_id(), new_span_id()
    assert len(t) == 32 and int(t, 16) and len(s) == 16 and int(s, 16)
    assert new_trace_id() != t


def test_span_rejects_negative_duration() -> None:
    with pytest.raises(ValueError, match="ends"):
        span("x", Level.LAYER, 10, 5)


def test_round_trip_dict() -> None:
    s = span("aten::conv2d", Level.LAYER, 1, 9, op_type="aten::conv2d", input_shapes=["[1, 3]"])
    t = Trace(new_trace_id(), (s,))
    back = Trace.from_dict(t.to_dict())
    assert back == t and back.spans[0].level is Level.LAYER


def test_nest_by_containment_per_track_and_across_threads() -> None:
    model = span("predict", Level.MODEL, 0, 100)
    conv = span("conv", Level.LAYER, 10, 50)
    inner = span("mkldnn_conv", Level.LAYER, 20, 40)
    relu = span("relu", Level.LAYER, 60, 70)
    other_thread = span("intra-op", Level.LAYER, 30, 35, thread="t2")
    outside = span("late", Level.LAYER, 200, 210)
    out = {s.name: s for s in nest([model, conv, inner, relu, other_thread, outside])}
    assert out["predict"].parent_id is None
    assert out["conv"].parent_id == model.span_id
    assert out["mkldnn_conv"].parent_id == conv.span_id
    assert out["relu"].parent_id == model.span_id
    # a layer on another thread of the process belongs to the shallower-level model span
    assert out["intra-op"].parent_id == model.span_id
    assert out["late"].parent_id is None


def test_nest_keeps_known_parents_and_equal_extents_do_not_cycle() -> None:
    a = span("a", Level.MODEL, 0, 10)
    b = span("b", Level.LAYER, 0, 10)
    c = Span("c", Level.LAYER, 2, 3, (P, "main"), parent_id="feedfeedfeedfeed")
    out = {s.name: s for s in nest([b, a, c])}
    assert out["a"].parent_id is None and out["b"].parent_id == a.span_id
    assert out["c"].parent_id == "feedfeedfeedfeed"


def test_kernels_nest_under_their_launch_by_correlation() -> None:
    op = span("aten::mm", Level.LAYER, 0, 100)
    launch = span("cudaLaunchKernel", Level.KERNEL, 10, 20, correlation=7, kind="launch")
    kernel = Span(
        "sgemm",
        Level.KERNEL,
        500,
        900,
        ("cuda:0", "stream 7"),
        attributes={"correlation": 7, "kind": "kernel"},
    )
    out = {s.name: s for s in nest([op, launch, kernel])}
    assert out["cudaLaunchKernel"].parent_id == op.span_id
    assert out["sgemm"].parent_id == launch.span_id


def test_walk_is_depth_first_in_start_order() -> None:
    model = span("predict", Level.MODEL, 0, 100)
    spans = nest(
        [
            span("b", Level.LAYER, 50, 60),
            model,
            span("a", Level.LAYER, 10, 40),
            span("a.1", Level.LAYER, 15, 20),
        ]
    )
    walked = [(d, s.name) for d, s in Trace(new_trace_id(), tuple(spans)).walk()]
    assert walked == [(0, "predict"), (1, "a"), (2, "a.1"), (1, "b")]
