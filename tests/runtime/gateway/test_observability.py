"""Metrics scraped from /metrics and spans carried from the gateway into the worker."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.gateway import echo_spec


@pytest.fixture
def spans() -> Iterator[object]:
    """An in-memory exporter on the process's SDK tracer provider.

    OpenTelemetry allows one global provider per process: this installs an SDK one if none is
    there yet, else adds the exporter to the existing one.
    """
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()


async def test_metrics_count_invocations_cold_starts_and_instances(start_gateway):
    gw = await start_gateway()
    await gw.deploy(echo_spec())
    for body in (b"a", b"b", b"crash"):
        await gw.invoke("echo", body)
    async with gw.session.get(f"{gw.url}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    assert value("trims_invocations_total", function="echo", status="200") == 2
    assert value("trims_invocations_total", function="echo", status="502") == 1
    assert value("trims_cold_starts_total", function="echo") == 1
    assert value("trims_instance_failures_total", function="echo") == 1
    assert value("trims_queue_wait_seconds_count", function="echo") == 3
    assert value("trims_execution_seconds_count", function="echo") == 3
    assert value("trims_cold_start_seconds_count", function="echo") == 1
    assert ("trims_instances", (("function", "echo"), ("state", "ready"))) in samples


async def test_trace_context_reaches_the_handler(start_gateway, spans):
    gw = await start_gateway()
    await gw.deploy(echo_spec())
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    caller = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    status, _, body = await gw.invoke("echo", b"trace", caller)
    assert status == 200
    seen_trace, _ = body.decode().split("-")
    assert seen_trace == trace_id

    finished = {
        s.name: s for s in spans.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_id
    }
    assert {"gateway request", "queue", "instance start", "invoke"} <= set(finished)
    request = finished["gateway request"]
    assert f"{request.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert finished["queue"].parent.span_id == request.context.span_id
    assert finished["instance start"].parent.span_id == finished["queue"].context.span_id
    assert finished["invoke"].parent.span_id == request.context.span_id


async def test_model_acquire_time_is_reported_by_the_worker(start_gateway, start_daemon):
    import numpy as np

    daemon = start_daemon(models={"lin": {"w": np.ones((4, 4), np.float32)}})
    gw = await start_gateway(store_socket=daemon.socket)
    spec = echo_spec("withmodel")
    spec["models"] = [{"name": "lin", "framework": "numpy"}]
    await gw.deploy(spec)
    await gw.deploy(echo_spec("nomodel"))
    for name in ("withmodel", "nomodel"):
        status, _, body = await gw.invoke(name, b"x")
        assert status == 200, body
    async with gw.session.get(f"{gw.url}/metrics") as r:
        text = await r.text()
    counts = {
        s.labels["function"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "trims_model_acquire_seconds_count"
    }
    assert counts.get("withmodel") == 1
    assert counts.get("nomodel", 0) == 0
    sums = {
        s.labels["function"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "trims_model_acquire_seconds_sum"
    }
    assert sums["withmodel"] > 0
