"""A function that needs its models in memory: its init refuses a model the store served from
another tier than the cpu tier (an acquire the store degraded for want of room) with
``resource_exhausted``, as the store refuses an acquire it cannot fit. It echoes, or says its
pid for ``pid``."""

from __future__ import annotations

import os

from trims.errors import ResourceExhausted
from trims.runtime.functions.context import Context, Request


def init(ctx: Context) -> None:
    for key, model in ctx.models.items():
        tier = getattr(getattr(model, "lease", None), "tier", "cpu")
        if tier != "cpu":
            raise ResourceExhausted(
                f"model {key} was served from the {tier} tier: this function needs it in the "
                "cpu tier; retry once the store has room"
            )


def handler(request: Request, ctx: Context) -> bytes:
    return str(os.getpid()).encode() if request.body == b"pid" else request.body
