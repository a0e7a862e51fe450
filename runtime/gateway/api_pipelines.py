"""``/v1/pipelines``: create, update, list, get, delete and invoke pipelines of functions."""

from __future__ import annotations

from aiohttp import web

from trims.errors import AlreadyExists, ValidationError
from trims.runtime.gateway.api_functions import outcome_response
from trims.runtime.gateway.context import auth_of, gateway_of, json_response, read_body, read_json
from trims.runtime.gateway.pipelines import parse_pipeline


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
    body = await read_body(request, first.spec.scaling.max_body_bytes)
    content_type = request.headers.get("Content-Type", "application/octet-stream")
    return outcome_response(await gateway.run_pipeline(spec.name, body, content_type))


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/pipelines", list_pipelines)
    app.router.add_post("/v1/pipelines", create_pipeline)
    app.router.add_get("/v1/pipelines/{name}", get_pipeline)
    app.router.add_put("/v1/pipelines/{name}", put_pipeline)
    app.router.add_delete("/v1/pipelines/{name}", delete_pipeline)
    app.router.add_post("/v1/pipelines/{name}/invoke", invoke_pipeline)
