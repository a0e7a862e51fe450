"""OTLP export: the protobuf a collector receives decodes to the same span tree."""

from __future__ import annotations

import socket

import pytest

from tests.fixtures.otlp import OtlpReceiver
from tests.trims.tracing.traces import sample_trace
from trims.errors import Unavailable
from trims.tracing.otlp import decode, encode, export


def test_encode_groups_by_process_with_service_names() -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    trace = sample_trace()
    req = ExportTraceServiceRequest()
    req.ParseFromString(encode(trace, service_names={"gateway": "trims-gateway"}))
    services = {
        kv.value.string_value
        for rs in req.resource_spans
        for kv in rs.resource.attributes
        if kv.key == "service.name"
    }
    assert services == {"trims-gateway", "worker 4242"}
    spans = [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    server = next(s for s in spans if s.name.startswith("POST"))
    assert server.kind == 2  # SPAN_KIND_SERVER
    assert server.trace_id == bytes.fromhex(trace.trace_id) and len(server.span_id) == 8
    levels = {
        s.name: kv.value.string_value
        for s in spans
        for kv in s.attributes
        if kv.key == "trims.level"
    }
    assert levels["aten::conv2d"] == "layer" and levels["predict"] == "model"


def test_export_reaches_the_receiver_as_the_same_tree(otlp_receiver: OtlpReceiver) -> None:
    trace = sample_trace()
    export(trace, otlp_receiver.endpoint)
    got = otlp_receiver.wait_for(trace.trace_id, len(trace.spans))
    assert otlp_receiver.errors == []
    assert sorted(got.spans, key=lambda s: s.span_id) == sorted(
        trace.spans, key=lambda s: s.span_id
    )
    assert [(d, s.name) for d, s in got.walk()] == [(d, s.name) for d, s in trace.walk()]


def test_decode_round_trip_keeps_attribute_types() -> None:
    trace = sample_trace()
    (back,) = decode(encode(trace))
    conv = next(s for s in back.spans if s.name == "aten::conv2d")
    assert conv.attributes == {
        "op_type": "aten::conv2d",
        "input_shapes": ["[1, 3, 8, 8]", "[4, 3, 3, 3]"],
        "depth": 0,
        "share": 0.5,
        "fused": False,
    }


def test_receiver_takes_the_opentelemetry_sdk_exporter(otlp_receiver: OtlpReceiver) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "gateway"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(otlp_receiver.endpoint)))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("request") as outer, tracer.start_as_current_span("queue"):
        pass
    provider.shutdown()
    trace_id = format(outer.get_span_context().trace_id, "032x")
    got = otlp_receiver.wait_for(trace_id, 2)
    by_name = {s.name: s for s in got.spans}
    assert by_name["queue"].parent_id == by_name["request"].span_id
    assert by_name["request"].track[0] == "gateway"


def test_export_to_nothing_raises_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(Unavailable, match=f"127.0.0.1:{port}/v1/traces: "):
        export(sample_trace(), f"http://127.0.0.1:{port}/v1/traces", timeout_s=5)


def test_export_to_a_wrong_path_raises_unavailable(otlp_receiver: OtlpReceiver) -> None:
    with pytest.raises(Unavailable, match="HTTP 404"):
        export(sample_trace(), otlp_receiver.endpoint.replace("/v1/traces", "/v1/logs"))
