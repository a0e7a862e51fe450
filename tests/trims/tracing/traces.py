"""A small hand-made trace shared by the export tests: gateway -> worker -> model -> layers."""

from __future__ import annotations

from trims.tracing.levels import Level
from trims.tracing.spans import Span, Trace, nest, new_trace_id

T0 = 1_700_000_000_000_000_000


def sample_trace() -> Trace:
    gw = ("gateway", "event loop")
    wk = ("worker 4242", "thread 1")
    spans = [
        Span(
            "POST /v1/functions/f/invoke",
            Level.SERVICE,
            T0,
            T0 + 9_000_000,
            gw,
            attributes={"span.kind": "server", "http.status_code": 200},
        ),
        Span("invoke", Level.SERVICE, T0 + 500_000, T0 + 8_500_000, wk),
        Span(
            "predict", Level.MODEL, T0 + 1_000_000, T0 + 8_000_000, wk, attributes={"model": "cnn"}
        ),
        Span(
            "aten::conv2d",
            Level.LAYER,
            T0 + 1_100_000,
            T0 + 5_000_123,
            wk,
            attributes={
                "op_type": "aten::conv2d",
                "input_shapes": ["[1, 3, 8, 8]", "[4, 3, 3, 3]"],
                "depth": 0,
                "share": 0.5,
                "fused": False,
            },
        ),
        Span(
            "aten::relu",
            Level.LAYER,
            T0 + 5_100_000,
            T0 + 6_000_000,
            ("worker 4242", "thread 2"),
            attributes={"op_type": "aten::relu"},
        ),
    ]
    return Trace(new_trace_id(), tuple(nest(spans)))
