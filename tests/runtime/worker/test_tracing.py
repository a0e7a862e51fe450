"""A traced request in a worker: the level in the request meta, the spans in the reply meta."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

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
