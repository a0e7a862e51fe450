"""The aiohttp application: middlewares, routes and the gateway's lifecycle.

``create_app(settings, executor_factory)`` builds the app; its cleanup context starts the
:class:`Gateway` (restoring saved functions) on startup and drains and closes it on cleanup.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from trims.runtime.gateway import api_functions, api_oip, api_pipelines, traces
from trims.runtime.gateway.auth import Authenticator
from trims.runtime.gateway.context import AUTH, GATEWAY, gateway_of, json_response
from trims.runtime.gateway.errors import error_middleware
from trims.runtime.gateway.metrics import http_metrics_middleware
from trims.runtime.gateway.openapi import openapi_document
from trims.runtime.gateway.service import ExecutorFactory, Gateway
from trims.runtime.settings import GatewaySettings
from trims.telemetry import extract_context

tracer = trace.get_tracer(__name__)

#: Paths not traced: probes and scrapes would drown the traces that matter.
_UNTRACED = frozenset({"/healthz", "/readyz", "/metrics", "/v2/health/live", "/v2/health/ready"})


@web.middleware
async def trace_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """One server span per request, continuing the caller's W3C trace context if it sent one."""
    if request.path in _UNTRACED:
        response: web.StreamResponse = await handler(request)
        return response
    carrier = {"traceparent": request.headers.get("traceparent", "")}
    if "tracestate" in request.headers:
        carrier["tracestate"] = request.headers["tracestate"]
    with tracer.start_as_current_span(
        "gateway request",
        context=extract_context(carrier) if carrier["traceparent"] else None,
        kind=SpanKind.SERVER,
        attributes={"http.method": request.method, "http.target": request.path},
    ) as span:
        response = await handler(request)
        span.set_attribute("http.status_code", response.status)
        return response


async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    if gateway_of(request).draining:
        return json_response({"status": "draining"}, 503)
    return json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    body = gateway_of(request).metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


async def openapi(request: web.Request) -> web.Response:
    return json_response(request.app[_OPENAPI])


_OPENAPI = web.AppKey("trims.openapi", dict)


def _mount_ui(app: web.Application, settings: GatewaySettings) -> None:
    """The results web UI at /ui/ (trims.evaluation.ui, imported here only: a core install
    without the evaluation extra starts, and its /ui/ says which extra to install)."""
    try:
        from trims.evaluation.ui import UIConfig, create_ui_app
    except ImportError as e:
        missing = f"The web UI needs the evaluation extra: pip install 'trims[evaluation]' ({e})."

        async def no_ui(request: web.Request) -> web.Response:
            return web.Response(status=404, text=missing)

        app.router.add_get("/ui/{tail:.*}", no_ui)
        return
    ui = UIConfig(results_db=settings.results_db, store_socket=settings.store_socket)
    app.router.add_get("/ui", _to_ui)  # before the sub-app, which would answer /ui with 404
    app.add_subapp("/ui", create_ui_app(ui))


async def _to_ui(request: web.Request) -> web.Response:
    return web.Response(status=308, headers={"Location": "/ui/"})


def create_app(settings: GatewaySettings, executor_factory: ExecutorFactory) -> web.Application:
    gateway = Gateway(settings, executor_factory)
    # Outermost first: the metrics middleware sees the status the error middleware answered.
    middlewares = [http_metrics_middleware(gateway.metrics), error_middleware]
    if gateway.tracing:
        middlewares.append(trace_middleware)
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_body_bytes)
    app[GATEWAY] = gateway
    app[AUTH] = Authenticator(
        settings.tokens,
        enabled=settings.auth,
        anonymous_scopes=settings.anonymous_scopes,
        token_file=settings.admin_token_file,
    )
    app[_OPENAPI] = openapi_document()
    api_functions.add_routes(app)
    api_pipelines.add_routes(app)
    api_oip.add_routes(app)
    traces.add_routes(app)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    _mount_ui(app, settings)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await gateway.start()
        yield
        await gateway.close(settings.drain_timeout_s)

    app.cleanup_ctx.append(lifecycle)
    return app
