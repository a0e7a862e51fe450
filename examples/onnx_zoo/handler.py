"""An ONNX Runtime session over a zoo model whose initializers live in the store's memory.

``infer`` is what the Open Inference Protocol calls (``POST /v2/models/onnx-squeezenet/infer``);
``handler`` takes a .npy array and answers the top-5 classes as JSON.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from trims.runtime.functions import ClientError, Context, Request

#: ONNX Runtime's input type strings -> the NumPy dtype a feed is cast to.
_DTYPES = {
    "tensor(bool)": np.bool_,
    "tensor(uint8)": np.uint8,
    "tensor(int8)": np.int8,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
    "tensor(float16)": np.float16,
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
}


def init(ctx: Context) -> None:
    # config.threads (an evaluation sets it to match the direct run) caps ONNX Runtime's
    # intra-op pool; without it the session uses one thread per core.
    threads = ctx.config.get("threads")
    options = None
    if threads is not None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = int(threads)
        options.inter_op_num_threads = 1
    session = ctx.models["model"].onnx_session(sess_options=options)
    ctx.state["session"] = session
    # Each input goes with the element type the model declares (an ALS model takes int64
    # user indices, a classifier float32 pixels).
    ctx.state["dtypes"] = {i.name: _DTYPES.get(i.type, np.float32) for i in session.get_inputs()}


def infer(inputs: dict[str, np.ndarray], ctx: Context) -> dict[str, np.ndarray]:
    session = ctx.state["session"]
    dtypes = ctx.state["dtypes"]
    names = [o.name for o in session.get_outputs()]
    feed = {k: np.ascontiguousarray(v, dtype=dtypes.get(k, np.float32)) for k, v in inputs.items()}
    return dict(zip(names, session.run(names, feed), strict=True))


def handler(request: Request, ctx: Context) -> dict[str, Any]:
    session = ctx.state["session"]
    first = session.get_inputs()[0]
    try:
        array = np.load(io.BytesIO(request.body), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ClientError(
            f"the body must be a .npy array (numpy.save) for input {first.name!r} of shape "
            f"{first.shape}: {e}",
            status=422,
        ) from None
    expected = [d if isinstance(d, int) else None for d in first.shape]
    if array.ndim != len(expected) or any(
        d is not None and d != n for d, n in zip(expected, array.shape, strict=True)
    ):
        raise ClientError(
            f"input {first.name!r} must have shape {first.shape} (a string is any size); got "
            f"{list(array.shape)}",
            status=422,
        )
    (output,) = infer({first.name: array}, ctx).values()
    scores = output.reshape(output.shape[0], -1)[0]
    top = np.argsort(scores)[::-1][:5]
    return {"top5": [{"class": int(c), "score": float(scores[c])} for c in top]}
