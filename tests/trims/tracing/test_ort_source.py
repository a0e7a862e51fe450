"""The ONNX Runtime source on a real ONNX CNN: node spans, clock, cleanup, faults."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trims.tracing.levels import Level
from trims.tracing.sources import NO_CUDA
from trims.tracing.sources.onnxruntime import NO_LIBRARY, collect, session_options
from trims.tracing.spans import Span, nest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")


def cnn_bytes() -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def init(name: str, shape: tuple[int, ...]) -> Any:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu1"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "G"], ["y"], name="fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 10])],
        [init("W", (8, 3, 3, 3)), init("B", (8,)), init("G", (10, 8))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


def test_node_spans_inside_the_callers_runs_and_the_profile_is_removed() -> None:
    options = session_options(Level.LAYER)
    prof_dir = Path(options.profile_file_prefix).parent
    assert prof_dir.stat().st_mode & 0o077 == 0
    sess = ort.InferenceSession(cnn_bytes(), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32)
    runs = []
    for _ in range(2):
        start = time.time_ns()
        (y,) = sess.run(None, {"x": x})
        runs.append(Span("predict", Level.MODEL, start, time.time_ns(), ("test", "caller")))
    assert y.shape == (2, 10)
    rec = collect(sess, process="test")
    assert rec.error is None and rec.unavailable == {}
    assert not prof_dir.exists()
    spans = nest([*runs, *rec.spans])
    layers = [s for s in spans if s.level is Level.LAYER]
    assert layers and len(layers) % 2 == 0
    # ORT's microsecond stamps: a node may start up to 1 us before the caller's reading
    run_ids = {r.span_id for r in runs}
    for s in layers:
        assert any(r.start_ns - 1000 <= s.start_ns and s.end_ns <= r.end_ns + 1000 for r in runs)
        assert s.track[0] == "test" and s.track[1].startswith("thread ")
        assert s.parent_id is None or s.parent_id in run_ids
    assert any(s.parent_id in run_ids for s in layers)
    assert {"Conv", "GlobalAveragePool", "Gemm"} <= {s.attributes["op_type"] for s in layers}
    gemm = next(s for s in layers if s.attributes["op_type"] == "Gemm")
    assert gemm.attributes["name"] == "fc" and gemm.attributes["input_shapes"][0] == "[2, 8]"
    assert gemm.attributes["provider"] == "CPUExecutionProvider"


def test_deeper_levels_are_reported_unavailable() -> None:
    sess = ort.InferenceSession(
        cnn_bytes(), session_options(Level.FULL), providers=["CPUExecutionProvider"]
    )
    sess.run(None, {"x": np.zeros((2, 3, 32, 32), np.float32)})
    rec = collect(sess, process="test", level=Level.FULL)
    assert rec.unavailable[Level.LIBRARY] == NO_LIBRARY
    assert rec.unavailable[Level.KERNEL] == NO_CUDA
    assert rec.spans


def test_unprofiled_session_sets_error_and_model_level_leaves_profiling_off() -> None:
    options = session_options(Level.MODEL)
    assert not options.enable_profiling
    sess = ort.InferenceSession(cnn_bytes(), options, providers=["CPUExecutionProvider"])
    (_y,) = sess.run(None, {"x": np.zeros((2, 3, 32, 32), np.float32)})
    rec = collect(sess, process="test")
    assert rec.spans == [] and rec.error is not None and "session_options" in rec.error


def test_unreadable_profile_sets_error(monkeypatch: pytest.MonkeyPatch) -> None:
    sess = ort.InferenceSession(
        cnn_bytes(), session_options(Level.LAYER), providers=["CPUExecutionProvider"]
    )
    sess.run(None, {"x": np.zeros((2, 3, 32, 32), np.float32)})
    real_end = sess.end_profiling

    def end_and_corrupt() -> str:
        path: str = real_end()
        Path(path).write_text("{not json")
        return path

    monkeypatch.setattr(sess, "end_profiling", end_and_corrupt)
    rec = collect(sess, process="test")
    assert rec.error is not None and "could not be read" in rec.error and rec.spans == []
