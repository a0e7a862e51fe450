"""The MXNet profiler source (runs in the MXNet environment, `-m mxnet`)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from trims.tracing.levels import Level
from trims.tracing.sources.mxnet import NO_KERNEL, NO_LIBRARY, _decode_events, profile
from trims.tracing.spans import Span, nest

pytestmark = pytest.mark.mxnet


def run_block(mx: Any) -> tuple[Any, Span, Any]:
    x = mx.nd.random.normal(shape=(2, 3, 32, 32))
    w = mx.nd.random.normal(shape=(8, 3, 3, 3))
    mx.nd.waitall()
    with profile(Level.FULL, process="test") as rec:
        start = time.time_ns()
        y = mx.nd.relu(mx.nd.Convolution(x, w, kernel=(3, 3), num_filter=8, no_bias=True))
        y.wait_to_read()
        end = time.time_ns()
    return rec, Span("predict", Level.MODEL, start, end, ("test", "caller")), y


def test_operators_become_layer_spans_inside_the_model_span() -> None:
    mx = pytest.importorskip("mxnet")
    for _ in range(2):  # twice: the second block reads only its own events
        rec, model_span, y = run_block(mx)
        assert y.shape == (2, 8, 30, 30) and rec.error is None
        assert rec.unavailable == {Level.LIBRARY: NO_LIBRARY, Level.KERNEL: NO_KERNEL}
        layers = [s for s in rec.spans if s.level is Level.LAYER]
        assert [s.attributes["op_type"] for s in layers if s.name != "Reorder"] == [
            "Convolution",
            "relu",
        ]
        spans = nest([model_span, *layers])
        for s in spans[1:]:
            assert model_span.contains(s), (s.name, s.start_ns - model_span.start_ns)
            assert s.parent_id == model_span.span_id and s.track[1].startswith("thread ")
        assert layers[0].attributes["name"] == "Convolution_0"


def test_block_exception_propagates() -> None:
    pytest.importorskip("mxnet")
    with pytest.raises(KeyError), profile(Level.LAYER, process="test"):
        raise KeyError("mine")


def test_decode_reads_unterminated_and_concatenated_dumps() -> None:
    data = '{\n"traceEvents": [\n{"name": "a", "ph": "B"},\n{"name": "a", "ph": "E"}\n{"x": 1}'
    assert _decode_events(data) == [{"name": "a", "ph": "B"}, {"name": "a", "ph": "E"}, {"x": 1}]
