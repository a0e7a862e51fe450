"""``/v1/functions``: deploy, update, list, get, delete, invoke; ``/v1/invocations/{id}``."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from trims.errors import ValidationError
from trims.runtime.functions.spec import parse_spec
from trims.runtime.gateway.context import (
    auth_of,
    gateway_of,
    json_response,
    read_body,
    read_json,
)
from trims.runtime.gateway.fastpath import HOP_HEADERS, check_reply
from trims.runtime.gateway.invocations import Outcome
from trims.runtime.gateway.traces import trace_headers_for_accept, traced_call


async def list_functions(request: web.Request) -> web.Response:
    auth_of(request).require_any(request)
    gateway = gateway_of(request)
    return json_response({"functions": [gateway.describe(n) for n in sorted(gateway.pools)]})


async def create_function(request: web.Request) -> web.Response:
    auth_of(request).require_admin(request)
    spec = parse_spec(_spec_object(await read_json(request)))
    gateway = gateway_of(request)
    await gateway.deploy(spec, replace=False)
    return json_response(
        gateway.describe(spec.name), 201, {"Location": f"/v1/functions/{spec.name}"}
    )


async def put_function(request: web.Request) -> web.Response:
    auth_of(request).require_admin(request)
    name = request.match_info["name"]
    doc = _spec_object(await read_json(request))
    if doc.setdefault("name", name) != name:
        raise ValidationError(
            f"name: the body names {doc['name']!r} but the path names {name!r}; make them equal",
            field="name",
        )
    spec = parse_spec(doc)
    gateway = gateway_of(request)
    created = await gateway.deploy(spec, replace=True)
    return json_response(gateway.describe(spec.name), 201 if created else 200)


async def get_function(request: web.Request) -> web.Response:
    auth_of(request).require_any(request)
    return json_response(gateway_of(request).describe(request.match_info["name"]))


async def delete_function(request: web.Request) -> web.Response:
    auth_of(request).require_admin(request)
    name = request.match_info["name"]
    await gateway_of(request).remove(name)
    return json_response({"deleted": name})


async def invoke_function(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    auth_of(request).require_invoke(request, (name,))
    gateway = gateway_of(request)
    pool = gateway.pool(name)
    traced = traced_call(request, name)
    body = await read_body(request, pool.spec.scaling.max_body_bytes)
    headers = request.headers
    if _wants_async(request):

        async def work() -> Outcome:
            return await gateway.invoke(name, body, headers, traced)

        record = gateway.invocations.submit(name, work)
        location = f"/v1/invocations/{record.id}"
        return json_response(
            {"id": record.id, "function": name, "state": record.state, "status_url": location},
            202,
            {"Location": location, **trace_headers_for_accept(traced)},
        )
    outcome = await gateway.invoke(name, body, headers, traced)
    return outcome_response(outcome)


def outcome_response(outcome: Outcome) -> web.Response:
    """The function's answer (the invoke fast path writes the same: fastpath.response_head)."""
    check_reply(outcome.status, outcome.headers)
    headers = {k: v for k, v in outcome.headers.items() if k.lower() not in HOP_HEADERS}
    return web.Response(status=outcome.status, body=outcome.body, headers=headers)


def _wants_async(request: web.Request) -> bool:
    flag = request.query.get("async")
    if flag is not None:
        if flag not in ("true", "false", "1", "0"):
            raise ValidationError(f"async: use true or false, got {flag!r}", field="async")
        return flag in ("true", "1")
    return "respond-async" in request.headers.get("Prefer", "")


async def get_invocation(request: web.Request) -> web.Response:
    gateway = gateway_of(request)
    auth = auth_of(request)
    auth.require_any(request)
    record = gateway.invocations.get(request.match_info["id"])
    auth.require_invoke(request, record.invokes)
    return json_response(record.to_dict())


def _spec_object(doc: Any) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ValidationError(
            "a function spec must be a JSON object; see FunctionSpec in /openapi.json"
        )
    return doc


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/functions", list_functions)
    app.router.add_post("/v1/functions", create_function)
    app.router.add_get("/v1/functions/{name}", get_function)
    app.router.add_put("/v1/functions/{name}", put_function)
    app.router.add_delete("/v1/functions/{name}", delete_function)
    app.router.add_post("/v1/functions/{name}/invoke", invoke_function)
    app.router.add_get("/v1/invocations/{id}", get_invocation)
