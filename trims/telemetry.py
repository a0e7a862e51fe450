"""Logging and OpenTelemetry set-up, done once in a process's main().

Spans are always created through the OpenTelemetry API; without :func:`setup_tracing` the API's
no-op provider makes them free. With an OTLP endpoint, spans are batched to it over HTTP.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from opentelemetry import trace

_configured_tracing = False


def setup_logging(level: str = "INFO") -> None:
    """One line per record: time, level, logger, message. Idempotent."""
    root = logging.getLogger()
    if any(getattr(h, "_trims", False) for h in root.handlers):
        root.setLevel(level.upper())
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    handler._trims = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())


def setup_tracing(service: str, otlp_endpoint: str | None = None) -> None:
    """Install an SDK tracer provider; export to OTLP/HTTP when an endpoint is given."""
    global _configured_tracing
    if _configured_tracing:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    trace.set_tracer_provider(provider)
    _configured_tracing = True


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_context() -> dict[str, str]:
    """The current span as W3C trace-context headers, to carry into another process."""
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier


def extract_context(carrier: dict[str, str]) -> Any:
    """An OpenTelemetry context from W3C headers received from another process."""
    from opentelemetry.propagate import extract

    return extract(carrier)


def otlp_endpoint_from_env(env: dict[str, str] | None = None) -> str | None:
    e = os.environ if env is None else env
    return e.get("TRIMS_OTLP_ENDPOINT") or e.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None
