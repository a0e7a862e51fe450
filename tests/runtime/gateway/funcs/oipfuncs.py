"""A served model for the Open Inference Protocol tests: doubles ``x``, echoes ``s``, and adds
``raw``, a BYTES output that is not UTF-8 text."""

from __future__ import annotations

import numpy as np

from trims.runtime.functions.context import Context


def infer(inputs: dict[str, np.ndarray], ctx: Context) -> dict[str, np.ndarray]:
    x = inputs["x"]
    raw = np.empty(1, dtype=object)
    raw[0] = b"\xff\xfe" + x.tobytes()[:4]
    out = {"y": (x * 2).astype(np.float32), "raw": raw}
    if "s" in inputs:
        out["t"] = inputs["s"]
    return out


def handler(request: object, ctx: Context) -> bytes:
    return b"use the Open Inference Protocol"
