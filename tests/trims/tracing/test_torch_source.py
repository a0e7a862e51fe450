"""The torch.profiler source on a real CNN: layers, clock, parents, oneDNN, faults."""

from __future__ import annotations

import time
from typing import Any

import pytest

from trims.tracing.levels import Level
from trims.tracing.sources.torch import NO_CUDA, profile
from trims.tracing.spans import Span, Trace, nest, new_trace_id

torch = pytest.importorskip("torch")


def cnn() -> Any:
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    ).eval()


def run_traced(level: Level) -> tuple[Any, Span, list[Span], Any]:
    """(recording, model span timed by the caller, nested spans, output)."""
    model, x = cnn(), torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        model(x)  # warm up: first-call allocations are not what we look at
        with profile(level, process="test") as rec:
            start = time.time_ns()
            out = model(x)
            end = time.time_ns()
    model_span = Span("predict", Level.MODEL, start, end, ("test", "caller"))
    return rec, model_span, nest([model_span, *rec.spans]), out


def test_layer_spans_sit_inside_the_callers_model_span() -> None:
    rec, model_span, spans, out = run_traced(Level.LAYER)
    assert rec.error is None and out.shape == (2, 10)
    layers = [s for s in spans if s.level is Level.LAYER]
    assert {"aten::conv2d", "aten::relu", "aten::linear"} <= {s.name for s in layers}
    for s in layers:
        assert model_span.contains(s), (s.name, s.start_ns - model_span.start_ns)
        assert s.track[0] == "test" and s.track[1].startswith("thread ")
        assert s.attributes["op_type"] == s.name
    top = [s for s in layers if s.attributes["depth"] == 0]
    assert all(s.parent_id == model_span.span_id for s in top)
    conv = [s for s in top if s.name == "aten::conv2d"]
    assert [s.attributes["name"] for s in conv] == ["aten::conv2d_0", "aten::conv2d_1"]
    assert conv[0].attributes["input_shapes"][:2] == ["[2, 3, 32, 32]", "[16, 3, 3, 3]"]
    assert Level.LIBRARY not in rec.unavailable and Level.KERNEL not in rec.unavailable


def test_nested_operators_parent_their_caller() -> None:
    _, _, spans, _ = run_traced(Level.LAYER)
    by_id = {s.span_id: s for s in spans}
    nested = [s for s in spans if s.level is Level.LAYER and s.attributes["depth"] > 0]
    assert nested
    for s in nested:
        parent = by_id[s.parent_id]  # type: ignore[index]
        assert parent.level is Level.LAYER and parent.contains(s)
        assert parent.attributes["depth"] == s.attributes["depth"] - 1  # type: ignore[operator]
    trace = Trace(new_trace_id(), tuple(spans))
    assert next(iter(trace.walk()))[1].name == "predict"


def test_top_level_layers_cover_most_of_the_model_span() -> None:
    _, model_span, spans, _ = run_traced(Level.LAYER)
    covered = sum(s.duration_ns for s in spans if s.parent_id == model_span.span_id)
    assert covered >= 0.5 * model_span.duration_ns


def test_library_level_places_onednn_primitives_under_operators() -> None:
    rec, _model_span, spans, _ = run_traced(Level.LIBRARY)
    if Level.LIBRARY in rec.unavailable:
        pytest.skip(f"library level unavailable here: {rec.unavailable[Level.LIBRARY]}")
    prims = [s for s in spans if s.level is Level.LIBRARY]
    assert any(s.attributes["op_type"] == "convolution" for s in prims)
    by_id = {s.span_id: s for s in spans}
    for s in prims:
        assert s.attributes["library"] == "oneDNN"
        parent = by_id[s.parent_id]  # type: ignore[index]
        assert parent.level is Level.LAYER
    conv_prims = [s for s in prims if s.attributes["op_type"] == "convolution"]
    assert all("convolution" in by_id[s.parent_id].name for s in conv_prims)  # type: ignore[index]


def test_library_capture_passes_other_stdout_through(capfd: pytest.CaptureFixture[str]) -> None:
    with profile(Level.LIBRARY, process="test"):
        print("from the block", flush=True)
    out = capfd.readouterr().out
    assert "from the block" in out and "onednn_verbose" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the refusal path without CUDA")
def test_kernel_level_without_cuda_is_unavailable_with_reason() -> None:
    rec, _, spans, _ = run_traced(Level.KERNEL)
    assert rec.unavailable[Level.KERNEL] == NO_CUDA
    assert not [s for s in spans if s.level is Level.KERNEL]
    assert [s for s in spans if s.level is Level.LAYER]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_level_on_cuda_links_kernels_to_launches() -> None:
    model, x = cnn().cuda(), torch.randn(2, 3, 32, 32, device="cuda")
    with torch.no_grad():
        model(x)
        torch.cuda.synchronize()
        with profile(Level.KERNEL, process="test") as rec:
            model(x)
            torch.cuda.synchronize()
    assert rec.error is None and Level.KERNEL not in rec.unavailable
    spans = nest(rec.spans)
    by_id = {s.span_id: s for s in spans}
    kernels = [s for s in spans if s.attributes.get("kind") == "kernel"]
    assert kernels
    for k in kernels:
        launch = by_id[k.parent_id]  # type: ignore[index]
        assert launch.attributes["kind"] == "launch"
        assert launch.attributes["correlation"] == k.attributes["correlation"]


def test_block_exception_propagates_untouched() -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom), profile(Level.LIBRARY, process="test"):
        raise Boom


def test_failing_profiler_sets_error_and_the_work_still_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(self: Any) -> None:
        raise RuntimeError("profiler start exploded")

    monkeypatch.setattr(torch.profiler.profile, "start", broken)
    model, x = cnn(), torch.randn(1, 3, 16, 16)
    with torch.no_grad(), profile(Level.LAYER, process="test") as rec:
        out = model(x)
    assert out.shape == (1, 10)
    assert rec.error is not None and "profiler start exploded" in rec.error
    assert rec.spans == []


def test_model_level_records_nothing() -> None:
    with profile(Level.MODEL, process="test") as rec:
        pass
    assert rec.spans == [] and rec.error is None and rec.unavailable == {}
