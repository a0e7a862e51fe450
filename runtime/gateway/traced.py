"""A traced invocation at the gateway: its spans, the worker's, the assembled trace and its ends.

A request that asks for a trace (``trims-trace-level``, parsed and authorized in
:mod:`trims.runtime.gateway.traces`) gets a :class:`TracedCall`. The gateway records its own
``service`` spans on track ``("gateway", "event loop")``: ``gateway request`` (the whole
request), ``queue`` (waiting for an instance slot), ``instance start`` (inside the queue span,
when the request waited for a cold start) and ``invoke <function>`` / ``infer <function>`` (the
round trip to the worker). The request goes to the worker with the level in its meta; the
worker's spans come back in the reply meta (see :mod:`trims.runtime.worker.tracing`). The
worker's root span is made a child of the round trip span, the rest is nested by
:func:`trims.tracing.spans.nest`, and the trace is kept in the :class:`TraceStore` and exported
over OTLP in the background (:class:`TraceExporter`), never delaying the response.

Untraced requests never reach this module: :class:`TracedCall` exists only when the header is
there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from trims.errors import NotFound
from trims.runtime.wire import (
    META_HEADERS,
    META_STATUS,
    META_TRACE,
    TRACE_LEVEL,
    TRACE_REPLY,
    Kind,
    decode_arrays,
    encode_arrays,
)
from trims.tracing.levels import Level
from trims.tracing.spans import Span, Trace, nest, new_span_id

__all__ = [
    "GATEWAY_TRACK",
    "StoredTrace",
    "TraceExporter",
    "TraceStore",
    "TracedCall",
    "response_headers",
]

log = logging.getLogger(__name__)

#: The track of the gateway's own spans (one event loop does all of a request's work).
GATEWAY_TRACK = ("gateway", "event loop")


@dataclass
class TracedCall:
    """One traced request: what the gateway recorded and what the worker sent back."""

    function: str
    level: Level
    trace_id: str
    #: The caller's span (W3C ``traceparent``) or the gateway's OpenTelemetry request span:
    #: the parent of ``gateway request``, so the trace joins the one the caller sees.
    parent_id: str | None
    target: str
    start_ns: int = field(default_factory=time.time_ns)
    request_span_id: str = field(default_factory=new_span_id)
    arrived_ns: int = 0
    spans: list[Span] = field(default_factory=list)
    worker: Mapping[str, Any] = field(default_factory=dict)
    #: Set when the gateway could not carry the trace to the instance.
    error: str | None = None
    #: The ``invoke``/``infer`` round trip span: the parent of the worker's span.
    round_trip_id: str | None = None
    #: The response's ``trims-trace-*`` headers, once the trace is finished.
    headers: dict[str, str] = field(default_factory=dict)

    def queued(self) -> None:
        """The request reaches the function's pool (the queue span starts here)."""
        self.arrived_ns = time.time_ns()

    def _service(self, name: str, start: int, end: int, **attributes: Any) -> Span:
        span = Span(
            name,
            Level.SERVICE,
            start,
            max(start, end),
            GATEWAY_TRACK,
            attributes={"function": self.function, **attributes},
        )
        self.spans.append(span)
        return span

    def _waited(self, start_window: tuple[int, int] | None, instance_id: str) -> None:
        """The queue span, and the instance start inside it when this request waited for one."""
        now = time.time_ns()
        self._service("queue", self.arrived_ns, now)
        if start_window is not None and start_window[1] >= self.arrived_ns:
            started, ready = start_window
            self._service(
                "instance start",
                max(started, self.arrived_ns),
                min(ready, now),
                instance=instance_id,
            )

    async def invoke(
        self,
        instance: Any,
        body: bytes,
        headers: Mapping[str, str],
        *,
        timeout: float,
        carrier: Mapping[str, str],
        start_window: tuple[int, int] | None,
    ) -> tuple[int, Mapping[str, str], bytes]:
        """The request on ``instance`` with the level in its meta; (status, headers, body)."""
        self._waited(start_window, instance.id)
        meta: dict[str, Any] = {META_HEADERS: dict(headers), TRACE_LEVEL: self.level.label}
        if carrier:
            meta[META_TRACE] = dict(carrier)
        frame = await self._round_trip(instance, Kind.INVOKE, meta, body, timeout)
        m = frame.meta
        return int(m.get(META_STATUS, 200)), m.get(META_HEADERS) or {}, frame.body

    async def infer(
        self,
        instance: Any,
        inputs: Mapping[str, Any],
        *,
        timeout: float,
        carrier: Mapping[str, str],
        start_window: tuple[int, int] | None,
    ) -> dict[str, Any]:
        self._waited(start_window, instance.id)
        meta: dict[str, Any] = {TRACE_LEVEL: self.level.label}
        if carrier:
            meta[META_TRACE] = dict(carrier)
        frame = await self._round_trip(instance, Kind.INFER, meta, encode_arrays(inputs), timeout)
        return decode_arrays(frame.body)

    async def _round_trip(
        self, instance: Any, kind: Kind, meta: dict[str, Any], body: bytes, timeout: float
    ) -> Any:
        start = time.time_ns()
        name = f"{'infer' if kind is Kind.INFER else 'invoke'} {self.function}"
        try:
            frame = await instance.request(kind, meta, body, timeout=timeout)
        finally:
            span = self._service(name, start, time.time_ns(), instance=instance.id)
            self.round_trip_id = span.span_id
        self.worker = frame.meta.get(TRACE_REPLY) or {}
        return frame

    def trace(self) -> Trace:
        """Gateway and worker spans in one trace, parents resolved (Note [parents])."""
        request = Span(
            "gateway request",
            Level.SERVICE,
            self.start_ns,
            time.time_ns(),
            GATEWAY_TRACK,
            span_id=self.request_span_id,
            parent_id=self.parent_id,
            attributes={
                "function": self.function,
                "http.target": self.target,
                "trims.level": self.level.label,
            },
        )
        worker: list[Span] = []
        for doc in self.worker.get("spans") or ():
            span = Span.from_dict(doc)
            if span.parent_id is None and span.level is Level.SERVICE and self.round_trip_id:
                span = replace(span, parent_id=self.round_trip_id)
            worker.append(span)
        nested = Trace(self.trace_id, tuple(nest([request, *self.spans, *worker])))
        return Trace(self.trace_id, tuple(s for _, s in nested.walk()))

    @property
    def unavailable(self) -> dict[str, str]:
        return dict(self.worker.get("unavailable") or {})

    @property
    def profiler_error(self) -> str | None:
        error = self.worker.get("error") or self.error
        return str(error) if error else None

    @property
    def truncated(self) -> int:
        return int(self.worker.get("truncated") or 0)


def response_headers(call: TracedCall) -> dict[str, str]:
    """``trims-trace-id`` and ``-level``, plus ``-unavailable``, ``-error`` and ``-truncated``
    when they apply; values made safe for a header line."""
    headers = {"trims-trace-id": call.trace_id, "trims-trace-level": call.level.label}
    if call.unavailable:
        headers["trims-trace-unavailable"] = ";".join(
            f"{level}={_header_value(reason).replace(';', ',')}"
            for level, reason in call.unavailable.items()
        )
    if call.profiler_error:
        headers["trims-trace-error"] = _header_value(call.profiler_error)
    if call.truncated:
        headers["trims-trace-truncated"] = str(call.truncated)
    return headers


def _header_value(text: str, limit: int = 1000) -> str:
    flat = " ".join(text.split())
    return flat.encode("ascii", "replace").decode()[:limit]


@dataclass(frozen=True)
class StoredTrace:
    function: str
    level: str
    #: The JSON document ``GET /v1/traces/{id}`` answers.
    body: bytes

    def trace(self) -> Trace:
        return Trace.from_dict(json.loads(self.body))


class TraceStore:
    """The last traces, bounded by count and by bytes of JSON; the oldest go first."""

    def __init__(self, *, count: int, max_bytes: int) -> None:
        self._count = count
        self._max_bytes = max_bytes
        self._bytes = 0
        self._traces: OrderedDict[str, StoredTrace] = OrderedDict()

    def put(self, call: TracedCall, trace: Trace) -> None:
        doc = {
            **trace.to_dict(),
            "function": call.function,
            "level": call.level.label,
            "unavailable": call.unavailable,
            "error": call.profiler_error,
            "truncated": call.truncated,
        }
        body = json.dumps(doc, separators=(",", ":")).encode()
        if self._count == 0 or len(body) > self._max_bytes:
            log.warning(
                "trace %s of %s not kept: %d bytes of spans, the store keeps %d traces and "
                "%d bytes (traces_kept, traces_kept_bytes)",
                trace.trace_id, call.function, len(body), self._count, self._max_bytes,
            )  # fmt: skip
            return
        old = self._traces.pop(trace.trace_id, None)
        if old is not None:
            self._bytes -= len(old.body)
        self._traces[trace.trace_id] = StoredTrace(call.function, call.level.label, body)
        self._bytes += len(body)
        while len(self._traces) > self._count or self._bytes > self._max_bytes:
            _, dropped = self._traces.popitem(last=False)
            self._bytes -= len(dropped.body)

    def ids(self) -> list[dict[str, str]]:
        """The kept traces, newest first: id, function, level."""
        return [
            {"trace_id": k, "function": v.function, "level": v.level}
            for k, v in reversed(self._traces.items())
        ]

    def get(self, trace_id: str) -> StoredTrace:
        stored = self._traces.get(trace_id)
        if stored is None:
            raise NotFound(
                f"no trace {trace_id!r} on this gateway: it keeps the last {self._count} traces "
                "of invocations sent with trims-trace-level (and only those that fit its byte "
                "budget); invoke again with the header"
            )
        return stored


class TraceExporter:
    """OTLP export of finished traces in named background tasks; :meth:`close` waits for them."""

    def __init__(self, endpoint: str | None) -> None:
        self.endpoint = endpoint
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(self, trace: Trace) -> None:
        if self.endpoint is None:
            return
        task = asyncio.create_task(self._export(trace), name=f"trims-otlp-{trace.trace_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _export(self, trace: Trace) -> None:
        from trims.tracing.otlp import export

        assert self.endpoint is not None
        try:
            await asyncio.to_thread(export, trace, self.endpoint)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("trace %s not exported over OTLP: %s", trace.trace_id, e)

    async def close(self, timeout_s: float) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=max(timeout_s, 0.001))
        for task in list(self._tasks):
            task.cancel()
