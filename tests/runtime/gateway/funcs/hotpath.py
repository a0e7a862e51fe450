"""A function for the hot-path tests: echoes, or reports what the garbage collector froze."""

from __future__ import annotations

import gc

from trims.runtime.functions.context import Context, Request

#: Objects frozen when this module was imported (after the fork: a zygote's own freeze).
FROZEN_AT_IMPORT = gc.get_freeze_count()


async def handler(request: Request, ctx: Context) -> str:
    if request.body == b"frozen":
        return f"{FROZEN_AT_IMPORT} {gc.get_freeze_count()}"
    return request.body.decode()
