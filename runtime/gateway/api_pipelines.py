"""``/v1/pipelines``: create, update, list, get, delete and invoke pipelines of functions.

``POST /v1/pipelines/{name}/invoke`` answers the pipeline's output with a ``Server-Timing``
header (each step's time and the total, see :mod:`trims.runtime.gateway.pipelines`);
``?outputs=true`` or the header ``trims-pipeline-outputs: true`` asks for the JSON envelope of
every step's output instead; ``?async=true`` or ``Prefer: respond-async`` runs it as an
asynchronous invocation (202, then ``GET /v1/invocations/{id}``, whose result carries
``server_timing``). Each run is counted and its steps' times observed in the gateway metrics.
"""

from __future__ import annotations

from aiohttp import web

from trims.errors import AlreadyExists, TrimsError, ValidationError
from trims.runtime.gateway.api_functions import outcome_response
from trims.runtime.gateway.context import auth_of, gateway_of, json_response, read_body, read_json
from trims.runtime.gateway.invocations import Outcome
from trims.runtime.gateway.pipelines import (
    OUTPUTS_HEADER,
    TOTAL_METRIC,
    PipelineSpec,
    execute_pipeline,
    parse_pipeline,
)
from trims.runtime.gateway.service import Gateway

_TRUE, _FALSE = ("true", "1"), ("false", "0")


async def list_pipelines(request: web.Request) -> web.Response:
    auth_of(request).require_any(request)
    gateway = gateway_of(request)
    return json_response(
        {"pipelines": [gateway.pipelines[n].to_dict() for n in sorted(gateway.pipelines)]}
    )


async def create_pipeline(request: web.Request) -> web.Response:
    auth_of(request).require_admin(request)
    spec = parse_pipeline(await read_json(request))
    gateway = gateway_of(request)
    if spec.name in gateway.pipelines:
        raise AlreadyExists(
            f"pipeline {spec.name} exists; PUT /v1/pipelines/{spec.name} updates it"
        )
    gateway.put_pipeline(spec)
    return json_response(spec.to_dict(), 201, {"Location": f"/v1/pipelines/{spec.name}"})


async def put_pipeline(request: web.Request) -> web.Response:
    auth_of(request).require_admin(request)
    name = request.match_info["name"]
    doc = await read_json(request)
    if isinstance(doc, dict) and doc.setdefault("name", name) != name:
        raise ValidationError(
            f"name: the body names {doc['name']!r} but the path names {name!r}; make them equal"
        )
    spec = parse_pipeline(doc)
    created = gateway_of(request).put_pipeline(spec)
    return json_response(spec.to_dict(), 201 if created else 200)


async def get_pipeline(request: web.Request) -> web.Response:
    auth_of(request).require_any(request)
    return json_response(gateway_of(request).pipeline(request.match_info["name"]).to_dict())


async def delete_pipeline(request: web.Request) -> web.Response:
    auth_of(request).require_admin(request)
    name = request.match_info["name"]
    gateway_of(request).remove_pipeline(name)
    return json_response({"deleted": name})


async def invoke_pipeline(request: web.Request) -> web.Response:
    gateway = gateway_of(request)
    spec = gateway.pipeline(request.match_info["name"])
    auth_of(request).require_invoke(request, spec.functions)
    first = gateway.pool(spec.steps[0].function)
    outputs = _flag(request, "outputs", request.headers.get(OUTPUTS_HEADER))
    wants_async = _flag(request, "async", None) or "respond-async" in request.headers.get(
        "Prefer", ""
    )
    body = await read_body(request, first.spec.scaling.max_body_bytes)
    content_type = request.headers.get("Content-Type", "application/octet-stream")
    if wants_async:

        async def work() -> Outcome:
            return await run_timed(gateway, spec, body, content_type, outputs=outputs)

        record = gateway.invocations.submit(
            spec.steps[0].function, work, pipeline=spec.name, functions=spec.functions
        )
        location = f"/v1/invocations/{record.id}"
        return json_response(
            {"id": record.id, "pipeline": spec.name, "state": record.state, "status_url": location},
            202,
            {"Location": location},
        )
    return outcome_response(await run_timed(gateway, spec, body, content_type, outputs=outputs))


async def run_timed(
    gateway: Gateway, spec: PipelineSpec, body: bytes, content_type: str, *, outputs: bool
) -> Outcome:
    """Run the pipeline, record its metrics; its answer, or the outputs envelope."""
    metrics = gateway.metrics

    async def call(function: str, step_body: bytes, step_type: str) -> Outcome:
        return await gateway.invoke(function, step_body, {"Content-Type": step_type})

    status = "error"
    try:
        run = await execute_pipeline(spec, body, content_type, call)
        status = str(run.outcome.status)
    except TrimsError as e:
        status = str(e.http_status)
        raise
    finally:
        metrics.pipeline_invocations.labels(spec.name, status).inc()
    for stage in run.stages:
        metrics.pipeline_stage.labels(spec.name, stage.step).observe(stage.duration_s)
    metrics.pipeline_stage.labels(spec.name, TOTAL_METRIC).observe(run.total_s)
    if outputs:
        return run.envelope(gateway.settings.max_body_bytes)
    return run.outcome


def _flag(request: web.Request, name: str, header: str | None) -> bool:
    """A ``true``/``false`` query parameter ``name`` (else the header's value); default false."""
    value = request.query.get(name, header)
    if value is None:
        return False
    value = value.strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValidationError(f"{name}: use true or false, got {value!r}", field=name)
    return value in _TRUE


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/pipelines", list_pipelines)
    app.router.add_post("/v1/pipelines", create_pipeline)
    app.router.add_get("/v1/pipelines/{name}", get_pipeline)
    app.router.add_put("/v1/pipelines/{name}", put_pipeline)
    app.router.add_delete("/v1/pipelines/{name}", delete_pipeline)
    app.router.add_post("/v1/pipelines/{name}/invoke", invoke_pipeline)
