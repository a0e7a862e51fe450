"""An ONNX Runtime session over a zoo model whose initializers live in the store's memory.

``infer`` is what the Open Inference Protocol calls (``POST /v2/models/onnx-squeezenet/infer``);
``handler`` takes a .npy array and answers the top-5 classes as JSON.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from trims.runtime.functions import Context, Request


def init(ctx: Context) -> None:
    ctx.state["session"] = ctx.models["model"].onnx_session()


def infer(inputs: dict[str, np.ndarray], ctx: Context) -> dict[str, np.ndarray]:
    session = ctx.state["session"]
    names = [o.name for o in session.get_outputs()]
    feed = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in inputs.items()}
    return dict(zip(names, session.run(names, feed), strict=True))


def handler(request: Request, ctx: Context) -> dict[str, Any]:
    session = ctx.state["session"]
    array = np.load(io.BytesIO(request.body), allow_pickle=False)
    (output,) = infer({session.get_inputs()[0].name: array}, ctx).values()
    scores = output.reshape(output.shape[0], -1)[0]
    top = np.argsort(scores)[::-1][:5]
    return {"top5": [{"class": int(c), "score": float(scores[c])} for c in top]}
