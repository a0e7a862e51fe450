"""A function whose init(ctx) fails: its instances never become ready."""

from __future__ import annotations

from typing import Any

from trims.runtime.functions.context import Context, Request


def init(ctx: Context) -> None:
    raise RuntimeError("init refuses to start: the config lacks 'answer'")


def handler(request: Request, ctx: Context) -> Any:
    return b"unreachable"
