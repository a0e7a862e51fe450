"""Pipeline step ``classify``: a ``.npy`` input tensor -> the model's first output, ``.npy``.

The ONNX model is ``ctx.models["model"]``, mapped from the store; a tensor one rank short of
the model's input gets the batch axis added.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from trims.runtime.functions import Context, Request, Response

NPY = "application/x-npy"


def init(ctx: Context) -> None:
    ctx.state["session"] = ctx.models["model"].onnx_session()


def handler(request: Request, ctx: Context) -> Any:
    session = ctx.state["session"]
    first = session.get_inputs()[0]
    x = np.load(io.BytesIO(request.body), allow_pickle=False).astype(np.float32)
    if x.ndim == len(first.shape) - 1:
        x = x[np.newaxis]
    (y, *_) = session.run(None, {first.name: np.ascontiguousarray(x)})
    out = io.BytesIO()
    np.save(out, np.asarray(y, dtype=np.float32), allow_pickle=False)
    return Response(body=out.getvalue(), headers={"Content-Type": NPY})
