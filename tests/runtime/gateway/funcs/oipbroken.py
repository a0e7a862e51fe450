"""A served model whose init(ctx) always fails: its instances never become ready."""

from __future__ import annotations

import numpy as np

from trims.runtime.functions.context import Context


def init(ctx: Context) -> None:
    raise RuntimeError("init refuses to start: the config lacks 'answer'")


def infer(inputs: dict[str, np.ndarray], ctx: Context) -> dict[str, np.ndarray]:
    return inputs


def handler(request: object, ctx: Context) -> bytes:
    return b"unreachable"
