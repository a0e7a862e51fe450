"""``trims-trace-level`` on invocations, and ``GET /v1/traces/{trace_id}`` for the kept traces.

Any invocation (``POST /v1/functions/{name}/invoke``, sync or async, and the Open Inference
Protocol's ``POST /v2/models/{name}/infer``) may send ``trims-trace-level: model|layer|library|
kernel|full``. Profiling costs the instance time, so it needs the ``trace`` (or
``trace:<function>``) scope; ``admin`` has it, anonymous callers only when the gateway's
anonymous scopes name it. An unknown level is refused with 400 listing the levels; ``none`` or
no header traces nothing (and costs nothing: one header lookup).

The trace id is the gateway's OpenTelemetry request span's when OpenTelemetry is configured
(it continues the caller's ``traceparent``), else the caller's ``traceparent`` trace id, else
a new one; it comes back in ``trims-trace-id``. ``GET /v1/traces/{id}`` answers the kept trace
as JSON (:meth:`trims.tracing.spans.Trace.to_dict` plus ``function``, ``level``,
``unavailable``, ``error``, ``truncated``; spans depth-first, each naming its ``parent_id``),
``?format=chrome`` as a Chrome trace-event file (Perfetto UI, ``chrome://tracing``).
"""

from __future__ import annotations

import json
import re

from aiohttp import web
from opentelemetry import trace as otel_trace

from trims.errors import RequestError, ValidationError
from trims.runtime.gateway.context import auth_of, gateway_of, json_response
from trims.runtime.gateway.traced import TracedCall
from trims.tracing.levels import Level, parse_level
from trims.tracing.spans import new_trace_id

__all__ = ["TRACE_LEVEL_HEADER", "add_routes", "trace_headers_for_accept", "traced_call"]

#: The request header that asks for a trace (names are case-insensitive).
TRACE_LEVEL_HEADER = "trims-trace-level"
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


def traced_call(request: web.Request, function: str) -> TracedCall | None:
    """The request's trace, or None when it asks for none. 400 for an unknown level, 401/403
    without the trace scope (the request is then not run at all)."""
    raw = request.headers.get(TRACE_LEVEL_HEADER)
    if raw is None:
        return None
    try:
        level = parse_level(raw, field=TRACE_LEVEL_HEADER)
    except ValidationError as e:
        raise RequestError(e.message) from None
    if level is Level.NONE:
        return None
    auth_of(request).require_trace(request, function)
    trace_id, parent_id = _trace_context(request)
    return TracedCall(
        function=function, level=level, trace_id=trace_id, parent_id=parent_id, target=request.path
    )


def _trace_context(request: web.Request) -> tuple[str, str | None]:
    if gateway_of(request).tracing:
        ctx = otel_trace.get_current_span().get_span_context()
        if ctx.is_valid:
            return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
    m = _TRACEPARENT.fullmatch(request.headers.get("traceparent", "").strip().lower())
    if m and m.group(1) != _ZERO_TRACE and m.group(2) != _ZERO_SPAN:
        return m.group(1), m.group(2)
    return new_trace_id(), None


def trace_headers_for_accept(call: TracedCall | None) -> dict[str, str]:
    """The headers of a 202 (async) answer: the trace id, known before the work runs."""
    if call is None:
        return {}
    return {"trims-trace-id": call.trace_id, "trims-trace-level": call.level.label}


async def get_trace(request: web.Request) -> web.Response:
    auth = auth_of(request)
    auth.require_trace(request, None)
    trace_id = request.match_info["trace_id"]
    stored = gateway_of(request).traces.get(trace_id)
    auth.require_trace(request, stored.function)
    fmt = request.query.get("format", "json")
    if fmt == "json":
        return web.Response(body=stored.body, content_type="application/json")
    if fmt == "chrome":
        from trims.tracing.chrome import to_chrome

        return web.Response(
            body=json.dumps(to_chrome(stored.trace())).encode(),
            content_type="application/json",
            headers={"Content-Disposition": f'attachment; filename="{trace_id}.trace.json"'},
        )
    raise RequestError(f"format: use json or chrome, got {fmt!r}")


async def list_traces(request: web.Request) -> web.Response:
    auth_of(request).require_trace(request, None)
    return json_response({"traces": gateway_of(request).traces.ids()})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/traces", list_traces)
    app.router.add_get("/v1/traces/{trace_id}", get_trace)
