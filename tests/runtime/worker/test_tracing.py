"""A traced request in a worker: the level in the request meta, the spans in the reply meta."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trims.runtime.executors.base import Instance
from trims.runtime.functions.spec import FunctionSpec
from trims.runtime.wire import TRACE_LEVEL, TRACE_REPLY, Kind
from trims.runtime.worker import tracing
from trims.runtime.worker.tracing import MAX_SPANS, RequestTrace
from trims.tracing.levels import Level
from trims.tracing.spans import Span

ECHO = """
def handler(request, ctx):
    return request.body
"""


async def test_the_worker_answers_a_traced_request_with_its_spans_in_the_meta(
    make_function: Callable[..., FunctionSpec],
    start_instance: Callable[..., Awaitable[Instance]],
) -> None:
    instance = await start_instance(make_function(ECHO))
    assert hasattr(instance, "request")
    plain = await instance.request(Kind.INVOKE, {"h": {}}, b"hi", timeout=30)
    assert plain.body == b"hi" and TRACE_REPLY not in plain.meta

    frame = await instance.request(Kind.INVOKE, {"h": {}, TRACE_LEVEL: "model"}, b"hi", timeout=30)
    assert frame.body == b"hi", "spans never ride in the body"
    spans = [Span.from_dict(d) for d in frame.meta[TRACE_REPLY]["spans"]]
    worker, model = spans
    assert (worker.name, worker.level, worker.parent_id) == ("worker fn", Level.SERVICE, None)
    assert worker.track == (f"worker {instance.pid}", "event loop")
    assert (model.name, model.level, model.parent_id) == ("handler fn", Level.MODEL, worker.span_id)
    assert worker.contains(model)
    assert "unavailable" not in frame.meta[TRACE_REPLY]


def test_spans_over_the_cap_are_dropped_shortest_first_and_counted() -> None:
    trace = RequestTrace("layer", "fn", "fn-1")
    pid = f"worker {os.getpid()}"
    trace.spans = [
        Span(f"op{i}", Level.LAYER, 1_000, 1_000 + i, (pid, "t")) for i in range(MAX_SPANS + 10)
    ]
    out = trace.finish()
    assert out["truncated"] == 11, "the worker span counts against the cap too"
    names = {d["name"] for d in out["spans"]}
    assert len(names) == MAX_SPANS and "worker fn" in names
    assert "op0" not in names and f"op{MAX_SPANS + 9}" in names


def test_a_profiler_that_fails_to_start_leaves_the_call_and_its_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("torch")
    from trims.tracing.sources import torch as torch_source

    @contextmanager
    def broken(level: Level, *, process: str) -> Iterator[Any]:
        raise RuntimeError("profiler unavailable in this test")
        yield

    monkeypatch.setattr(torch_source, "profile", broken)
    trace = RequestTrace("layer", "fn", "fn-1")
    assert trace.wrap(lambda x: x + 1, False, "handler fn")(41) == 42
    out = trace.finish()
    assert "profiler unavailable in this test" in out["error"]
    assert [d["level"] for d in out["spans"]] == ["service", "model"]


def test_without_a_framework_layers_are_unavailable_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(tracing.sys.modules, "torch", raising=False)
    monkeypatch.delitem(tracing.sys.modules, "onnxruntime", raising=False)
    trace = RequestTrace("full", "fn", "fn-1")
    assert trace.wrap(lambda: "ok", False, "handler fn")() == "ok"
    out = trace.finish()
    assert set(out["unavailable"]) == {"layer", "library", "kernel"}
    assert "torch" in out["unavailable"]["layer"]


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_trims_onnx_runtime_session_gives_the_layer_spans_under_the_model_span(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, is_async: bool
) -> None:
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from tests.fixtures.models import small_cnn
    from trims.runtime.direct import DirectModel

    path = tmp_path / "cnn.onnx"
    onnx.save(small_cnn(), str(path))
    session = DirectModel("cnn", path).onnx_session()
    monkeypatch.delitem(tracing.sys.modules, "torch", raising=False)
    x = np.ones((1, 3, 16, 16), np.float32)

    def predict() -> Any:
        return session.run(None, {"x": x})[0]

    async def predict_async() -> Any:
        return predict()

    trace = RequestTrace("layer", "fn", "fn-1")
    if is_async:
        y = asyncio.run(trace.wrap(predict_async, True, "handler fn")())
    else:
        y = trace.wrap(predict, False, "handler fn")()
    assert y.tobytes() == predict().tobytes()
    out = trace.finish()
    assert "unavailable" not in out and "error" not in out, out
    spans = [Span.from_dict(d) for d in out["spans"]]
    worker, handler, setup, *layers = spans
    assert (handler.name, handler.level, handler.parent_id) == (
        "handler fn",
        Level.MODEL,
        worker.span_id,
    )
    assert (setup.name, setup.level) == ("profiled session cnn", Level.MODEL)
    assert layers and all(s.level is Level.LAYER and handler.contains(s) for s in layers)
    assert {s.track[0] for s in spans} == {f"worker {os.getpid()}"}


def test_an_onnx_runtime_session_built_by_hand_is_named_as_why_layers_are_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from tests.fixtures.models import small_cnn

    session = ort.InferenceSession(
        small_cnn().SerializeToString(), providers=["CPUExecutionProvider"]
    )
    monkeypatch.delitem(tracing.sys.modules, "torch", raising=False)
    trace = RequestTrace("layer", "fn", "fn-1")
    x = np.ones((1, 3, 16, 16), np.float32)
    trace.wrap(lambda: session.run(None, {"x": x}), False, "handler fn")()
    out = trace.finish()
    assert "onnx_session()" in out["unavailable"]["layer"]
    assert [d["level"] for d in out["spans"]] == ["service", "model"]
