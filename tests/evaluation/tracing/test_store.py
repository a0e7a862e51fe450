"""Traces in the results database: stored by id, read back, found for comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trims.errors import NotFound, ValidationError
from trims.evaluation.tracing import store
from trims.tracing.levels import Level
from trims.tracing.spans import Span, Trace, new_trace_id


def _trace() -> tuple[Trace, dict[str, object]]:
    predict = Span("predict m", Level.MODEL, 1_000, 5_000, ("trims trace", "thread 1"))
    layer = Span(
        "Conv",
        Level.LAYER,
        1_500,
        4_000,
        ("trims trace", "thread 1"),
        parent_id=predict.span_id,
        attributes={"op_type": "Conv", "input_shapes": ["[1, 3]"]},
    )
    trace = Trace(new_trace_id(), (predict, layer))
    return trace, {
        "model": "m",
        "framework": "onnxruntime",
        "trace_id": trace.trace_id,
        "layers": [],
        "untraced_ms": 0.004,
        "levels": [],
    }


def test_round_trip_by_trace_id(tmp_path: Path) -> None:
    db = str(tmp_path / "r.sqlite")
    trace, summary = _trace()
    store.save(db, trace, summary, "layer")
    loaded, body = store.load_trace(db, trace.trace_id)
    assert loaded == trace and body == summary
    assert store.load_summary(trace.trace_id, db) == summary
    with pytest.raises(NotFound, match="no trace"):
        store.load_trace(db, "0" * 32)


def test_summary_from_a_json_file(tmp_path: Path) -> None:
    _, summary = _trace()
    path = tmp_path / "s.json"
    path.write_text(json.dumps(summary))
    assert store.load_summary(str(path), None) == summary
    path.write_text("[1, 2]")
    with pytest.raises(ValidationError, match="not a trace summary"):
        store.load_summary(str(path), None)
