"""Functions the gateway tests deploy: echo with a few misbehaviours chosen by the body."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
from opentelemetry import trace

from trims.runtime.functions.context import Context, Request, Response


def handler(request: Request, ctx: Context) -> Any:
    body = request.body
    if body == b"crash":
        os.kill(os.getpid(), signal.SIGKILL)
    if body.startswith(b"sleep:"):
        time.sleep(float(body[6:]))
        return b"slept"
    if body == b"pid":
        return str(os.getpid())
    if body == b"trace":
        context = trace.get_current_span().get_span_context()
        return f"{context.trace_id:032x}-{context.span_id:016x}"
    if body == b"headers":
        return dict(request.headers)
    if body == b"split-header":
        return Response(body=b"x", headers={"x-note": "a\r\nx-injected: 1"})
    if body == b"garbage":
        return object()
    if body == b"hog":
        return str(np.ones(1 << 30, dtype=np.uint8).sum())
    return Response(body=body, headers={"Content-Type": request.content_type})


def upper(request: Request, ctx: Context) -> Any:
    return request.body.upper()


def infer(inputs: dict[str, np.ndarray], ctx: Context) -> dict[str, np.ndarray]:
    """A linear layer over the store's model 'lin': y = x @ w + b, and the row sums as INT64."""
    weights = ctx.models["lin"].numpy()
    y = inputs["x"] @ weights["w"] + weights["b"]
    return {"y": y.astype(np.float32), "n": inputs["x"].sum(axis=1).astype(np.int64)}
