"""Open Inference Protocol (KServe V2 / Triton HTTP) for functions that declare ``serves``.

Existing clients (``tritonclient.http``, KServe's ``InferenceRESTClient``, curl) work unchanged:
health, server and model metadata, model readiness and ``infer`` with the JSON tensor encoding
or Triton's binary extension. A model is "ready" when its function is deployed: instances start
on the first request like any other invocation.
"""

from __future__ import annotations

from aiohttp import web

from trims import __version__
from trims.errors import NotFound
from trims.runtime.functions.spec import ServedModel
from trims.runtime.gateway.context import auth_of, gateway_of, json_response, read_body
from trims.runtime.gateway.service import Gateway
from trims.runtime.gateway.tensors import (
    HEADER_LENGTH,
    check_inputs,
    encode_response,
    model_metadata,
    parse_request,
)
from trims.runtime.gateway.traces import traced_call


def _served(gateway: Gateway, name: str, version: str | None) -> ServedModel:
    pool = gateway.pools.get(name)
    if pool is None or pool.spec.serves is None:
        raise NotFound(
            f"no model named {name!r}: deploy a function of that name with 'serves' "
            "(GET /v1/functions lists functions)"
        )
    served = pool.spec.serves
    if version is not None and version not in served.versions:
        raise NotFound(
            f"model {name} has no version {version!r}; versions: {', '.join(served.versions)}"
        )
    return served


async def server_metadata(request: web.Request) -> web.Response:
    return json_response(
        {"name": "trims", "version": __version__, "extensions": ["binary_tensor_data"]}
    )


async def live(request: web.Request) -> web.Response:
    return json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    is_ready = not gateway_of(request).draining
    return json_response({"ready": is_ready}, 200 if is_ready else 503)


async def model_meta(request: web.Request) -> web.Response:
    auth_of(request).require_any(request)
    name = request.match_info["name"]
    served = _served(gateway_of(request), name, request.match_info.get("version"))
    return json_response(model_metadata(name, served))


async def model_ready(request: web.Request) -> web.Response:
    auth_of(request).require_any(request)
    name = request.match_info["name"]
    gateway = gateway_of(request)
    _served(gateway, name, request.match_info.get("version"))
    is_ready = not gateway.draining
    return json_response({"name": name, "ready": is_ready}, 200 if is_ready else 503)


async def infer(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    auth_of(request).require_invoke(request, (name,))
    gateway = gateway_of(request)
    version = request.match_info.get("version")
    served = _served(gateway, name, version)
    traced = traced_call(request, name)
    limit = gateway.pool(name).spec.scaling.max_body_bytes
    body = await read_body(request, limit)
    parsed = parse_request(body, request.headers.get(HEADER_LENGTH))
    check_inputs(name, served, parsed.inputs)
    outputs = await gateway.infer(name, parsed.inputs, traced)
    payload, headers = encode_response(
        name, version or served.versions[-1], parsed, outputs, served.outputs
    )
    if traced is not None:
        headers = {**headers, **traced.headers}
    return web.Response(body=payload, headers=headers)


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/v2", server_metadata)
    r.add_get("/v2/health/live", live)
    r.add_get("/v2/health/ready", ready)
    r.add_get("/v2/models/{name}", model_meta)
    r.add_get("/v2/models/{name}/ready", model_ready)
    r.add_post("/v2/models/{name}/infer", infer)
    r.add_get("/v2/models/{name}/versions/{version}", model_meta)
    r.add_get("/v2/models/{name}/versions/{version}/ready", model_ready)
    r.add_post("/v2/models/{name}/versions/{version}/infer", infer)
