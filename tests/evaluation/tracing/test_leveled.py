"""Leveled runs of a small real model in PyTorch and ONNX Runtime: levels, overhead, trace tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from trims.errors import ValidationError
from trims.evaluation.measure import MeasureSettings
from trims.evaluation.tracing import workload
from trims.evaluation.tracing.leveled import (
    LeveledResult,
    TraceSettings,
    coverage_pct,
    measure_levels,
    top_level,
)
from trims.tracing.levels import Level
from trims.tracing.spans import Span

FAST = MeasureSettings(warmup=1, min_reps=3, max_reps=5, max_time_s=0.5, clock="wall")


def leveled(path: Path, framework: str, level: Level = Level.LAYER) -> LeveledResult:
    w = workload.load(str(path), framework)
    try:
        return measure_levels(w, TraceSettings(level=level, measure=FAST))
    finally:
        w.close()


@pytest.mark.parametrize("framework", ["torch", "onnxruntime"])
def test_levels_overhead_and_trace_tree(residual_path: Path, framework: str) -> None:
    result = leveled(residual_path, framework)
    assert [r.level for r in result.levels] == [Level.MODEL, Level.LAYER]
    assert result.untraced.reps >= 3 and result.untraced.trimmed_mean_ms > 0
    for r in result.levels:
        assert 3 <= r.measurement.reps <= 5
        expected = 100.0 * (r.latency_ms / result.untraced.trimmed_mean_ms - 1.0)
        assert r.overhead_pct == pytest.approx(expected)
    assert result.coverage_pct is not None and 0 < result.coverage_pct <= 100
    # the tree: one predict at the root, model-level pre/post-processing and layers below it
    walk = list(result.trace.walk())
    depth0 = [s for d, s in walk if d == 0]
    assert [s.name for s in depth0] == ["predict residual"]
    (predict,) = depth0
    assert {s.name for d, s in walk if d == 1 and s.level is Level.MODEL} == {
        "preprocess",
        "postprocess",
    }
    layers = top_level(result.trace.spans)
    assert len(layers) >= 5  # five convolutions at least
    model_ids = {s.span_id for s in result.trace.by_level(Level.MODEL)}
    assert all(s.parent_id in model_ids for s in layers)
    convs = [s for s in layers if s.attributes.get("op_type") in ("Conv", "aten::conv2d")]
    assert len(convs) == 5 and all(s.parent_id == predict.span_id for s in convs)
    assert all(s.attributes["run"] == "layer" for s in result.trace.by_level(Level.LAYER))
    assert result.trace.trace_id and len(result.trace.trace_id) == 32


def test_unavailable_levels_are_named_not_dropped(residual_path: Path) -> None:
    result = leveled(residual_path, "onnxruntime", Level.FULL)
    assert [r.level for r in result.levels] == [Level.MODEL, Level.LAYER]
    assert set(result.unavailable) == {Level.LIBRARY, Level.KERNEL}
    assert all(result.unavailable.values())


def test_coverage_is_the_union_of_intervals() -> None:
    track = ("p", "t")
    window = Span("predict", Level.MODEL, 0, 100, track)
    spans = [
        Span("a", Level.LAYER, 10, 30, track),
        Span("b", Level.LAYER, 20, 40, track),  # overlaps a: counted once
        Span("c", Level.LAYER, 90, 120, track),  # clipped to the window
        Span("d", Level.LAYER, 150, 160, track),  # outside
    ]
    assert coverage_pct(spans, window) == pytest.approx(40.0)
    assert coverage_pct([], window) == 0.0


def test_bad_framework_and_settings_are_refused(residual_path: Path) -> None:
    with pytest.raises(ValidationError, match="torch, onnxruntime, mxnet"):
        workload.load(str(residual_path), "tensorflow")
    with pytest.raises(ValidationError, match="wall clock"):
        TraceSettings(measure=MeasureSettings())
