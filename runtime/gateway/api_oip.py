"""Open Inference Protocol (KServe V2 / Triton HTTP) for functions that declare ``serves``.

Existing clients (``tritonclient.http``, KServe's ``InferenceRESTClient``, curl) work unchanged:
health, server and model metadata, model readiness and ``infer`` with the JSON tensor encoding,
Triton's binary extension or system shared memory (:mod:`trims.runtime.gateway.api_oip_shm`),
and Triton's model repository extension (:mod:`trims.runtime.gateway.oip_repository`, which
also says when a model and the server are ready). Errors under ``/v2`` are the spec's
``{"error": "<message>"}`` (:mod:`trims.runtime.gateway.errors`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from aiohttp import web

from trims import __version__
from trims.errors import NotFound
from trims.oip import HEADER_LENGTH, platform_of
from trims.runtime.functions.spec import ServedModel, TensorMeta
from trims.runtime.gateway import api_oip_shm, oip_repository
from trims.runtime.gateway.api_oip_shm import SharedMemory, owner_of, registry_of
from trims.runtime.gateway.context import auth_of, gateway_of, json_response, read_body
from trims.runtime.gateway.oip_repository import repository_of
from trims.runtime.gateway.tensors import (
    InferRequest,
    check_inputs,
    check_outputs,
    decode_tensor,
    encode_response,
    encode_tensor,
    model_metadata,
    output_datatype,
    parse_request,
)
from trims.runtime.gateway.traces import traced_call

#: What ``GET /v2`` lists, in Triton's names (and ``cuda_shared_memory`` where this process
#: can load the CUDA driver).
EXTENSIONS = ("binary_tensor_data", "model_repository", "system_shared_memory")


def _served(request: web.Request, name: str, version: str | None) -> ServedModel:
    pool = repository_of(request).served_pool(name)
    served = pool.spec.serves
    assert served is not None
    if version is not None and version not in served.versions:
        raise NotFound(
            f"model {name} has no version {version!r}; versions: {', '.join(served.versions)}"
        )
    return served


async def server_metadata(request: web.Request) -> web.Response:
    extensions = [*EXTENSIONS, *(["cuda_shared_memory"] if api_oip_shm.cuda_available() else [])]
    return json_response({"name": "trims", "version": __version__, "extensions": extensions})


async def live(request: web.Request) -> web.Response:
    return json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    is_ready = repository_of(request).server_ready()
    return json_response({"ready": is_ready}, 200 if is_ready else 503)


async def model_meta(request: web.Request) -> web.Response:
    auth_of(request).require_any(request)
    name = request.match_info["name"]
    served = _served(request, name, request.match_info.get("version"))
    spec = gateway_of(request).pool(name).spec
    platform = platform_of((m.framework for m in spec.models), served.platform)
    return json_response(model_metadata(name, served, platform))


async def model_ready(request: web.Request) -> web.Response:
    auth_of(request).require_any(request)
    name = request.match_info["name"]
    _served(request, name, request.match_info.get("version"))
    repository = repository_of(request)
    is_ready = repository.is_ready(name)
    doc: dict[str, Any] = {"name": name, "ready": is_ready}
    if not is_ready:
        reason = repository.state(name)[1]
        doc["reason"] = reason or "the gateway is shutting down"
    return json_response(doc, 200 if is_ready else 503)


async def infer(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    auth_of(request).require_invoke(request, (name,))
    gateway = gateway_of(request)
    version = request.match_info.get("version")
    served = _served(request, name, version)
    repository_of(request).check_loaded(name)
    traced = traced_call(request, name)
    limit = gateway.pool(name).spec.scaling.max_body_bytes
    body = await read_body(request, limit)
    parsed = parse_request(body, request.headers.get(HEADER_LENGTH))
    inputs = dict(parsed.inputs)
    wants_shm = bool(parsed.shm_inputs) or any(
        o.shm is not None for o in (parsed.outputs or {}).values()
    )
    owner = owner_of(request) if wants_shm else ""
    if parsed.shm_inputs:
        inputs.update(_read_shm_inputs(registry_of(request), owner, parsed))
    check_inputs(name, served, inputs)
    outputs = await gateway.infer(name, inputs, traced)
    in_shm = None
    if wants_shm:
        check_outputs(name, parsed, outputs)
        in_shm = _write_shm_outputs(registry_of(request), owner, parsed, outputs, served.outputs)
    payload, headers = encode_response(
        name, version or served.versions[-1], parsed, outputs, served.outputs, in_shm
    )
    if traced is not None:
        headers = {**headers, **traced.headers}
    return web.Response(body=payload, headers=headers)


def _read_shm_inputs(
    registry: SharedMemory, owner: str, parsed: InferRequest
) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for item in parsed.shm_inputs:
        what = f"input {item.name!r}"
        data = registry.read(owner, item.ref, what)
        out[item.name] = decode_tensor(item.name, item.datatype, item.shape, data)
    return out


def _write_shm_outputs(
    registry: SharedMemory,
    owner: str,
    parsed: InferRequest,
    outputs: Mapping[str, np.ndarray],
    declared: Sequence[TensorMeta],
) -> dict[str, dict[str, Any]]:
    """Write the outputs asked for in shared memory; the parameters their entries carry."""
    written: dict[str, dict[str, Any]] = {}
    for name, want in (parsed.outputs or {}).items():
        if want.shm is None:
            continue
        array = outputs[name]
        blob = encode_tensor(array, output_datatype(name, array, declared))
        registry.write(owner, want.shm, blob, f"output {name!r}")
        params = want.shm.parameters()
        params["shared_memory_byte_size"] = len(blob)
        written[name] = params
    return written


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
    oip_repository.add_routes(app)
    api_oip_shm.add_routes(app)
