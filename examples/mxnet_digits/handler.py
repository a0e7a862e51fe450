"""The digits MLP on MXNet, its weights NDArrays over the store's mapping (no copy).

``ctx.models["model"].mxnet()`` gives every tensor of the stored model as an ``mx.nd`` array
whose memory is the shared mapping: ``w1`` (64x64), ``b1``, ``w2`` (64x10), ``b2`` (the ONNX
file's initializers; its graph travels as one more tensor this handler does not need).

HTTP: ``{"pixels": [64 numbers, 0-16]}`` or ``{"images": [[64 numbers], ...]}`` (scikit-learn's
8x8 digits, row by row) -> ``{"digits": [...], "probabilities": [[10 numbers], ...]}``.
Open Inference Protocol: ``input`` FP32 [N, 64] already scaled to [0, 1] -> ``probabilities``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trims.runtime.functions import ClientError, Context, Request

FEATURES = 64
#: scikit-learn's digits are 0-16 grey levels; the model was trained on them divided by 16.
SCALE = 1.0 / 16.0


def init(ctx: Context) -> None:
    import mxnet as mx

    weights = ctx.models["model"].mxnet()
    ctx.state["mx"] = mx
    ctx.state["layers"] = [(weights["w1"], weights["b1"]), (weights["w2"], weights["b2"])]


def probabilities(x: np.ndarray, ctx: Context) -> np.ndarray:
    """softmax(relu(x W1 + b1) W2 + b2) on MXNet, for rows of 64 features in [0, 1]."""
    mx = ctx.state["mx"]
    (w1, b1), (w2, b2) = ctx.state["layers"]
    h = mx.nd.relu(mx.nd.broadcast_add(mx.nd.dot(mx.nd.array(x), w1), b1))
    logits = mx.nd.broadcast_add(mx.nd.dot(h, w2), b2)
    out: np.ndarray = mx.nd.softmax(logits, axis=1).asnumpy()
    return out


def infer(inputs: dict[str, np.ndarray], ctx: Context) -> dict[str, np.ndarray]:
    x = np.ascontiguousarray(inputs["input"], dtype=np.float32).reshape(-1, FEATURES)
    return {"probabilities": probabilities(x, ctx)}


def _images(body: Any) -> np.ndarray:
    """The request's images as float32 rows scaled to [0, 1]; a client mistake is a 422 that
    says what to send."""
    if not isinstance(body, dict) or not ({"pixels", "images"} & body.keys()):
        raise ClientError(
            'send {"pixels": [64 numbers]} or {"images": [[64 numbers], ...]}', status=422
        )
    rows = [body["pixels"]] if "pixels" in body else body["images"]
    try:
        x = np.asarray(rows, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise ClientError(f"images must be lists of 64 numbers: {e}", status=422) from None
    if x.ndim != 2 or x.shape[1] != FEATURES or len(x) == 0:
        raise ClientError(
            f"each image is 64 numbers (8x8, row by row); got shape {x.shape}", status=422
        )
    return x * SCALE


def handler(request: Request, ctx: Context) -> dict[str, Any]:
    p = probabilities(_images(request.json()), ctx).astype(np.float64)
    return {"digits": p.argmax(axis=1).tolist(), "probabilities": p.round(6).tolist()}
