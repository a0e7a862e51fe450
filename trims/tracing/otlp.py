"""OTLP export of a :class:`~trims.tracing.spans.Trace`: protobuf over OTLP/HTTP.

:func:`encode` builds an ``ExportTraceServiceRequest`` (the ``opentelemetry-proto`` classes
that come with the ``otlp`` extra): one ``ResourceSpans`` per track process, whose
``service.name`` is ``service_names[process]`` (default: the process name itself), one scope
``trims.tracing``, and per span its ids as bytes, start/end in Unix epoch ns, kind
(``span.kind`` attribute: server, client, producer, consumer; else internal) and attributes,
with ``trims.level`` (the level's name) and ``trims.thread`` (the track's thread) added.
:func:`decode` reads such a request back into traces (the test receiver uses it; spans from
other OpenTelemetry SDKs, without ``trims.level``, come back at the ``service`` level).
:func:`export` POSTs the request to a collector (Jaeger, Tempo, the OpenTelemetry Collector).
"""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from trims.errors import Unavailable
from trims.tracing.levels import Level
from trims.tracing.spans import AttrValue, Span, Trace

__all__ = ["decode", "encode", "export"]

log = logging.getLogger(__name__)

SCOPE = "trims.tracing"
_KINDS = {"internal": 1, "server": 2, "client": 3, "producer": 4, "consumer": 5}


def encode(trace: Trace, *, service_names: Mapping[str, str] | None = None) -> bytes:
    """The trace as a serialized ``ExportTraceServiceRequest``."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans
    from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan

    names = service_names or {}
    by_process: dict[str, list[Span]] = defaultdict(list)
    for s in trace.spans:
        by_process[s.track[0]].append(s)
    trace_id = bytes.fromhex(trace.trace_id)
    request = ExportTraceServiceRequest()
    for process, spans in by_process.items():
        resource = Resource(
            attributes=[
                _kv("service.name", names.get(process, process)),
                _kv("trims.process", process),
            ]
        )
        pb_spans = []
        for s in spans:
            attrs = {k: v for k, v in s.attributes.items() if k != "span.kind"}
            attrs["trims.level"] = s.level.label
            attrs["trims.thread"] = s.track[1]
            pb_spans.append(
                PbSpan(
                    trace_id=trace_id,
                    span_id=bytes.fromhex(s.span_id),
                    parent_span_id=bytes.fromhex(s.parent_id) if s.parent_id else b"",
                    name=s.name,
                    kind=_KINDS.get(str(s.attributes.get("span.kind", "internal")), 1),  # type: ignore[arg-type]
                    start_time_unix_nano=s.start_ns,
                    end_time_unix_nano=s.end_ns,
                    attributes=[_kv(k, v) for k, v in attrs.items()],
                )
            )
        request.resource_spans.append(
            ResourceSpans(
                resource=resource,
                scope_spans=[ScopeSpans(scope=InstrumentationScope(name=SCOPE), spans=pb_spans)],
            )
        )
    return bytes(request.SerializeToString())


def decode(body: bytes) -> list[Trace]:
    """The traces in a serialized ``ExportTraceServiceRequest``, in order of first span."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    traces: dict[str, list[Span]] = {}
    kinds = {v: k for k, v in _KINDS.items()}
    for rs in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        process = str(resource.get("trims.process", resource.get("service.name", "unknown")))
        for ss in rs.scope_spans:
            for p in ss.spans:
                attrs = {kv.key: _value(kv.value) for kv in p.attributes}
                level = Level[str(attrs.pop("trims.level", "service")).upper()]
                thread = str(attrs.pop("trims.thread", "main"))
                if p.kind in kinds and p.kind != 1:
                    attrs["span.kind"] = kinds[p.kind]
                span = Span(
                    name=p.name,
                    level=level,
                    start_ns=p.start_time_unix_nano,
                    end_ns=p.end_time_unix_nano,
                    track=(process, thread),
                    span_id=p.span_id.hex(),
                    parent_id=p.parent_span_id.hex() or None,
                    attributes=attrs,
                )
                traces.setdefault(p.trace_id.hex(), []).append(span)
    return [Trace(tid, tuple(spans)) for tid, spans in traces.items()]


def export(trace: Trace, endpoint: str, *, timeout_s: float = 10.0) -> None:
    """POST the trace to an OTLP/HTTP traces endpoint (``http://host:4318/v1/traces``).

    Raises :class:`~trims.errors.Unavailable` when the collector cannot be reached or
    answers with an error status.
    """
    body = encode(trace)
    req = urllib.request.Request(
        endpoint,
        data=body,
        method="POST",
        headers={"Content-Type": "application/x-protobuf"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read()
    except urllib.error.HTTPError as e:
        raise Unavailable(
            f"OTLP collector at {endpoint} refused trace {trace.trace_id} "
            f"({len(trace.spans)} spans): HTTP {e.code} {e.reason}; check that the URL is "
            "an OTLP/HTTP traces endpoint (.../v1/traces) that accepts protobuf"
        ) from e
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise Unavailable(
            f"cannot export trace {trace.trace_id} to OTLP collector at {endpoint}: {e}; "
            "check that the collector runs and the URL (http://host:4318/v1/traces) is right"
        ) from e
    log.info("trace %s exported to %s (%d spans)", trace.trace_id, endpoint, len(trace.spans))


def _kv(key: str, value: AttrValue) -> Any:
    from opentelemetry.proto.common.v1.common_pb2 import KeyValue

    return KeyValue(key=key, value=_any(value))


def _any(value: AttrValue) -> Any:
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue

    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, list):
        return AnyValue(array_value=ArrayValue(values=[_any(v) for v in value]))
    return AnyValue(string_value=str(value))


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which is None:
        return None
    return getattr(v, which)
