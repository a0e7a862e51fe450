"""A served model for the metrics tests: doubles ``x``; a negative first element fails."""

from __future__ import annotations

import numpy as np

from trims.runtime.functions.context import Context


def infer(inputs: dict[str, np.ndarray], ctx: Context) -> dict[str, np.ndarray]:
    x = inputs["x"]
    if x.size and float(x.flat[0]) < 0:
        raise RuntimeError("negative input")
    return {"y": (x * 2).astype(np.float32)}


def handler(request: object, ctx: Context) -> bytes:
    return b"ok"
