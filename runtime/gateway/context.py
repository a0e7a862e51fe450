"""What every HTTP handler needs: the gateway, the authenticator, and request-body helpers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from trims.errors import PayloadTooLarge, RequestError
from trims.runtime.gateway.auth import Authenticator
from trims.runtime.gateway.service import Gateway

GATEWAY = web.AppKey("trims.gateway", Gateway)
AUTH = web.AppKey("trims.auth", Authenticator)


def gateway_of(request: web.Request) -> Gateway:
    return request.app[GATEWAY]


def auth_of(request: web.Request) -> Authenticator:
    return request.app[AUTH]


async def _chunk(request: web.Request, read: Any) -> bytes:
    """One read of the body that fails when no byte arrives for the body timeout.

    A body that has arrived whole (a small request, with its head) has nothing to wait for:
    it is read without arming the timer (the hot path of small invocations).
    """
    if request.content.is_eof():
        chunk: bytes = await read()
        return chunk
    stall = gateway_of(request).settings.body_timeout_s
    try:
        async with asyncio.timeout(stall):
            chunk = await read()
            return chunk
    except TimeoutError:
        raise RequestError(
            f"the request body stalled: no bytes arrived for {stall:.0f}s; send it without "
            "pauses (the connection is closed)"
        ) from None


async def read_body(request: web.Request, limit: int) -> bytes:
    """The body, refusing with 413 as soon as it is known to exceed ``limit`` bytes.

    A body that stalls (no bytes for ``body_timeout_s``) is refused with 400; aiohttp then
    closes the connection because the body was not read to its end.
    """
    declared = request.content_length
    if declared is not None and declared > limit:
        raise PayloadTooLarge(
            f"request body of {declared} bytes exceeds this function's limit of {limit} bytes "
            "(scaling.max_body_bytes)",
            limit=limit,
        )
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = await _chunk(request, request.content.readany)
        if not chunk:
            break
        total += len(chunk)
        if total > limit:
            raise PayloadTooLarge(
                f"request body exceeds this function's limit of {limit} bytes "
                "(scaling.max_body_bytes)",
                limit=limit,
            )
        chunks.append(chunk)
    if declared is not None and total != declared:
        raise RequestError(f"the body ended after {total} of {declared} declared bytes")
    return b"".join(chunks)


async def read_json(request: web.Request) -> Any:
    """The body parsed as JSON; 400 saying what is wrong otherwise."""
    limit = gateway_of(request).settings.max_body_bytes
    body = await read_body(request, limit)
    if not body:
        raise RequestError("the request needs a JSON body")
    try:
        return json.loads(body)
    except ValueError as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None


def json_response(
    doc: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status,
        body=json.dumps(doc).encode(),
        content_type="application/json",
        headers=headers,
    )
