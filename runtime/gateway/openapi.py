"""The gateway's OpenAPI 3.1 document, served at ``/openapi.json``.

Every route the gateway registers is described here (a test compares the two); errors on every
operation share the ``Error`` schema. The function spec schema is the functions package's
:data:`FUNCTION_SCHEMA`, generated from the spec's typed model, so the document and the parser
cannot drift apart.
"""

from __future__ import annotations

import copy
from typing import Any

from trims import __version__
from trims.runtime.functions.schema import FUNCTION_SCHEMA
from trims.runtime.functions.spec import DATATYPES
from trims.runtime.gateway.pipelines import NAME_RE, PIPELINE_SCHEMA


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERROR = _json(_ref("Error"), "an error; the message says what to fix")
#: Under /v2 errors are the Open Inference Protocol's {"error": "<message>"}.
_OIP_ERROR = _json(_ref("OipError"), "an error; the message says what to fix")
_NAME = {
    "name": "name",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": NAME_RE.pattern},
}
_VERSION = {"name": "version", "in": "path", "required": True, "schema": {"type": "string"}}
_SECURED: list[dict[str, list[str]]] = [{"bearer": []}]
#: The header that asks an invocation for a trace (see trims.runtime.gateway.traces).
_TRACE_LEVEL = {
    "name": "trims-trace-level",
    "in": "header",
    "required": False,
    "description": "trace this invocation at this depth (needs the trace or trace:<function> "
    "scope); the response carries trims-trace-id, trims-trace-level and, where levels "
    "degraded or the profiler failed, trims-trace-unavailable (level=reason;...) and "
    "trims-trace-error; GET /v1/traces/{trace_id} then answers the trace",
    "schema": {"enum": ["none", "model", "layer", "library", "kernel", "full"]},
}
_TRACE_ID = {
    "name": "trace_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
}


def _op(
    summary: str,
    responses: dict[str, Any],
    *,
    params: list[dict[str, Any]] | None = None,
    body: dict[str, Any] | None = None,
    secured: bool = True,
    error: dict[str, Any] = _ERROR,
) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {**responses, "default": error}}
    if params:
        op["parameters"] = params
    if body is not None:
        op["requestBody"] = body
    if secured:
        op["security"] = _SECURED
    return op


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


_ANY_BODY = {"required": False, "content": {"*/*": {"schema": {}}}}
_ANY_RESPONSE = {"description": "the function's own response", "content": {"*/*": {"schema": {}}}}

_SPAN_SCHEMA = {
    "type": "object",
    "required": ["name", "level", "start_ns", "end_ns", "track", "span_id", "parent_id"],
    "properties": {
        "name": {"type": "string"},
        "level": {"enum": ["service", "model", "layer", "library", "kernel"]},
        "start_ns": {"type": "integer", "description": "Unix epoch nanoseconds"},
        "end_ns": {"type": "integer"},
        "track": {
            "type": "array",
            "items": {"type": "string"},
            "description": "[process, thread], e.g. [gateway, event loop]",
        },
        "span_id": {"type": "string"},
        "parent_id": {"type": ["string", "null"]},
        "attributes": {"type": "object"},
    },
}

_SCHEMAS: dict[str, Any] = {
    "Trace": {
        "type": "object",
        "required": ["trace_id", "spans", "function", "level"],
        "properties": {
            "trace_id": {"type": "string"},
            "function": {"type": "string"},
            "level": {"type": "string"},
            "spans": {
                "type": "array",
                "items": _SPAN_SCHEMA,
                "description": "depth-first from the root; each names its parent_id",
            },
            "unavailable": {
                "type": "object",
                "additionalProperties": {"type": "string"},
                "description": "level -> why the stack could not provide it",
            },
            "error": {"type": ["string", "null"], "description": "the profiler failed"},
            "truncated": {"type": "integer", "description": "spans dropped over the cap"},
        },
    },
    "TraceList": {
        "type": "object",
        "required": ["traces"],
        "properties": {
            "traces": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "trace_id": {"type": "string"},
                        "function": {"type": "string"},
                        "level": {"type": "string"},
                    },
                },
            }
        },
    },
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["code", "message"],
                "properties": {
                    "code": {"type": "string"},
                    "message": {"type": "string"},
                    "details": {"type": "object"},
                },
            }
        },
    },
    "OipError": {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "string"}},
    },
    "RepositoryIndex": {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["name", "state"],
            "properties": {
                "name": {"type": "string"},
                "version": {"type": "string"},
                "state": {"enum": ["READY", "UNAVAILABLE"]},
                "reason": {"type": "string"},
            },
        },
    },
    "SharedMemoryStatus": {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["name", "key", "offset", "byte_size"],
            "properties": {
                "name": {"type": "string"},
                "key": {"type": "string"},
                "offset": {"type": "integer"},
                "byte_size": {"type": "integer"},
            },
        },
    },
    "CudaSharedMemoryStatus": {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["name", "device_id", "byte_size"],
            "properties": {
                "name": {"type": "string"},
                "device_id": {"type": "integer"},
                "byte_size": {"type": "integer"},
            },
        },
    },
    "Instance": {
        "type": "object",
        "required": ["id", "state", "inflight"],
        "properties": {
            "id": {"type": "string"},
            "state": {"enum": ["standby", "starting", "ready", "draining"]},
            "inflight": {"type": "integer"},
            "served": {"type": "integer"},
            "alive": {"type": "boolean"},
            "executor": {"type": ["string", "null"]},
            "prepared": {
                "type": "boolean",
                "description": "a standby only: its preparation finished (scaling.standby)",
            },
        },
    },
    "Function": {
        "type": "object",
        "required": ["spec", "status"],
        "properties": {
            "spec": _ref("FunctionSpec"),
            "status": {
                "type": "object",
                "required": ["instances", "queued", "inflight"],
                "properties": {
                    "instances": {"type": "array", "items": _ref("Instance")},
                    "queued": {"type": "integer"},
                    "inflight": {"type": "integer"},
                },
            },
        },
    },
    "Deleted": {
        "type": "object",
        "required": ["deleted"],
        "properties": {"deleted": {"type": "string"}},
    },
    "Accepted": {
        "type": "object",
        "required": ["id", "function", "state", "status_url"],
        "properties": {
            "id": {"type": "string"},
            "function": {"type": "string"},
            "state": {"type": "string"},
            "status_url": {"type": "string"},
        },
    },
    "Invocation": {
        "type": "object",
        "required": ["id", "function", "state", "created"],
        "properties": {
            "id": {"type": "string"},
            "function": {"type": "string"},
            "state": {"enum": ["running", "succeeded", "failed"]},
            "created": {"type": "number"},
            "finished": {"type": ["number", "null"]},
            "result": {
                "type": "object",
                "required": ["status", "body", "encoding"],
                "properties": {
                    "status": {"type": "integer"},
                    "content_type": {"type": "string"},
                    "body": {"type": "string"},
                    "encoding": {"enum": ["utf-8", "base64"]},
                },
            },
            "error": {"type": "object"},
        },
    },
    "PipelineSpec": PIPELINE_SCHEMA,
    "Tensor": {
        "type": "object",
        "required": ["name", "shape", "datatype"],
        "properties": {
            "name": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "datatype": {"enum": list(DATATYPES)},
            "data": {"type": "array"},
            "parameters": {"type": "object"},
        },
    },
    "InferRequest": {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "id": {"type": ["string", "number"], "description": "echoed with its JSON type"},
            "parameters": {"type": "object"},
            "inputs": {"type": "array", "minItems": 1, "items": _ref("Tensor")},
            "outputs": {"type": "array", "items": {"type": "object", "required": ["name"]}},
        },
    },
    "InferResponse": {
        "type": "object",
        "required": ["model_name", "outputs"],
        "properties": {
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "id": {"type": ["string", "number"]},
            "outputs": {"type": "array", "items": _ref("Tensor")},
        },
    },
    "ModelMetadata": {
        "type": "object",
        "required": ["name", "versions", "platform", "inputs", "outputs"],
        "properties": {
            "name": {"type": "string"},
            "versions": {"type": "array", "items": {"type": "string"}},
            "platform": {"type": "string"},
            "inputs": {"type": "array", "items": {"type": "object"}},
            "outputs": {"type": "array", "items": {"type": "object"}},
        },
    },
}


def _function_spec_schema() -> dict[str, Any]:
    schema = copy.deepcopy(FUNCTION_SCHEMA)
    schema.pop("$schema", None)
    return schema


def _paths() -> dict[str, Any]:
    fn = _json(_ref("Function"), "the function with its instances")
    pipeline = _json(_ref("PipelineSpec"), "the pipeline")
    return {
        "/v1/functions": {
            "get": _op(
                "List functions",
                {
                    "200": _json(
                        {
                            "type": "object",
                            "required": ["functions"],
                            "properties": {
                                "functions": {"type": "array", "items": _ref("Function")}
                            },
                        },
                        "all functions",
                    )
                },
            ),
            "post": _op("Deploy a new function", {"201": fn}, body=_body(_ref("FunctionSpec"))),
        },
        "/v1/functions/{name}": {
            "get": _op("Get a function and its instances", {"200": fn}, params=[_NAME]),
            "put": _op(
                "Deploy or update a function",
                {"200": fn, "201": fn},
                params=[_NAME],
                body=_body(_ref("FunctionSpec")),
            ),
            "delete": _op(
                "Delete a function; its instances drain",
                {"200": _json(_ref("Deleted"), "deleted")},
                params=[_NAME],
            ),
        },
        "/v1/functions/{name}/invoke": {
            "post": _op(
                "Invoke a function (body passed through); ?async=true answers 202 with an id",
                {"200": _ANY_RESPONSE, "202": _json(_ref("Accepted"), "accepted; poll status_url")},
                params=[
                    _NAME,
                    {
                        "name": "async",
                        "in": "query",
                        "required": False,
                        "schema": {"enum": ["true", "false", "1", "0"]},
                    },
                    _TRACE_LEVEL,
                ],
                body=_ANY_BODY,
            )
        },
        "/v1/invocations/{id}": {
            "get": _op(
                "State and result of an asynchronous invocation",
                {"200": _json(_ref("Invocation"), "the invocation")},
                params=[
                    {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
            )
        },
        "/v1/pipelines": {
            "get": _op(
                "List pipelines",
                {
                    "200": _json(
                        {
                            "type": "object",
                            "required": ["pipelines"],
                            "properties": {
                                "pipelines": {"type": "array", "items": _ref("PipelineSpec")}
                            },
                        },
                        "all pipelines",
                    )
                },
            ),
            "post": _op("Create a pipeline", {"201": pipeline}, body=_body(_ref("PipelineSpec"))),
        },
        "/v1/pipelines/{name}": {
            "get": _op("Get a pipeline", {"200": pipeline}, params=[_NAME]),
            "put": _op(
                "Create or update a pipeline",
                {"200": pipeline, "201": pipeline},
                params=[_NAME],
                body=_body(_ref("PipelineSpec")),
            ),
            "delete": _op(
                "Delete a pipeline", {"200": _json(_ref("Deleted"), "deleted")}, params=[_NAME]
            ),
        },
        "/v1/pipelines/{name}/invoke": {
            "post": _op(
                "Invoke a pipeline as one request",
                {"200": _ANY_RESPONSE},
                params=[_NAME],
                body=_ANY_BODY,
            )
        },
        **_oip_paths(),
        "/v1/traces": {
            "get": _op(
                "The kept traces of traced invocations, newest first (trace scope)",
                {"200": _json(_ref("TraceList"), "trace ids with their function and level")},
            )
        },
        "/v1/traces/{trace_id}": {
            "get": _op(
                "A kept trace: the span tree as JSON, or ?format=chrome as a Chrome trace-event "
                "file (attachment <trace_id>.trace.json) for Perfetto UI (trace scope)",
                {
                    "200": _json(
                        {"oneOf": [_ref("Trace"), {"type": "object"}]},
                        "the trace (format=json), or Chrome trace-event JSON (format=chrome)",
                    )
                },
                params=[
                    _TRACE_ID,
                    {
                        "name": "format",
                        "in": "query",
                        "required": False,
                        "schema": {"enum": ["json", "chrome"]},
                    },
                ],
            )
        },
        "/healthz": {
            "get": _op(
                "The gateway process is up", {"200": _json({"type": "object"}, "ok")}, secured=False
            )
        },
        "/readyz": {
            "get": _op(
                "The gateway accepts requests (503 while draining)",
                {"200": _json({"type": "object"}, "ready")},
                secured=False,
            )
        },
        "/metrics": {
            "get": _op(
                "Prometheus metrics",
                {
                    "200": {
                        "description": "text exposition format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
                secured=False,
            )
        },
        "/openapi.json": {
            "get": _op(
                "This document", {"200": _json({"type": "object"}, "OpenAPI 3.1")}, secured=False
            )
        },
    }


def _oip(summary: str, responses: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return _op(summary, responses, error=_OIP_ERROR, **kw)


_REGION = {
    "name": "region",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,128}$"},
}
_EMPTY = _json({"type": "object"}, "done")


def _oip_paths() -> dict[str, Any]:
    """The Open Inference Protocol (errors as {"error": "<message>"})."""
    infer = {
        "description": "output tensors (JSON, or JSON + binary tensors with the binary extension)",
        "content": {
            "application/json": {"schema": _ref("InferResponse")},
            "application/octet-stream": {"schema": {}},
        },
    }
    infer_body = {
        "required": True,
        "content": {
            "application/json": {"schema": _ref("InferRequest")},
            "application/octet-stream": {"schema": {}},
        },
    }
    health = {
        "type": "object",
        "properties": {"live": {"type": "boolean"}, "ready": {"type": "boolean"}},
    }
    model_ready = {
        "type": "object",
        "required": ["name", "ready"],
        "properties": {
            "name": {"type": "string"},
            "ready": {"type": "boolean"},
            "reason": {"type": "string", "description": "why not (503 only)"},
        },
    }
    ready_resp = {
        "200": _json(model_ready, "ready"),
        "503": _json(model_ready, "not ready: unloaded, or its instances fail to start"),
    }
    optional_body = {
        "required": False,
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
    shm_status = _json(_ref("SharedMemoryStatus"), "this token's regions")
    register_body = _body(
        {
            "type": "object",
            "required": ["key", "byte_size"],
            "properties": {
                "key": {"type": "string"},
                "offset": {"type": "integer", "minimum": 0},
                "byte_size": {"type": "integer", "minimum": 1},
            },
        }
    )
    cuda_status = _json(_ref("CudaSharedMemoryStatus"), "this token's CUDA regions")
    cuda_body = _body(
        {
            "type": "object",
            "required": ["raw_handle", "device_id", "byte_size"],
            "properties": {
                "raw_handle": {
                    "type": "object",
                    "required": ["b64"],
                    "properties": {"b64": {"type": "string", "description": "64 bytes, base64"}},
                },
                "device_id": {"type": "integer", "minimum": 0},
                "byte_size": {"type": "integer", "minimum": 1},
            },
        }
    )
    shm = "/v2/systemsharedmemory"
    cuda = "/v2/cudasharedmemory"
    return {
        "/v2": {
            "get": _oip(
                "Server metadata",
                {"200": _json({"type": "object"}, "server metadata")},
                secured=False,
            )
        },
        "/v2/health/live": {"get": _oip("Liveness", {"200": _json(health, "live")}, secured=False)},
        "/v2/health/ready": {
            "get": _oip(
                "Readiness: not draining and every loaded model ready (503 otherwise)",
                {"200": _json(health, "ready"), "503": _json(health, "not ready")},
                secured=False,
            )
        },
        "/v2/models/{name}": {
            "get": _oip(
                "Model metadata", {"200": _json(_ref("ModelMetadata"), "metadata")}, params=[_NAME]
            )
        },
        "/v2/models/{name}/ready": {"get": _oip("Model readiness", ready_resp, params=[_NAME])},
        "/v2/models/{name}/infer": {
            "post": _oip("Inference", {"200": infer}, params=[_NAME, _TRACE_LEVEL], body=infer_body)
        },
        "/v2/models/{name}/versions/{version}": {
            "get": _oip(
                "Model version metadata",
                {"200": _json(_ref("ModelMetadata"), "metadata")},
                params=[_NAME, _VERSION],
            )
        },
        "/v2/models/{name}/versions/{version}/ready": {
            "get": _oip("Model version readiness", ready_resp, params=[_NAME, _VERSION])
        },
        "/v2/models/{name}/versions/{version}/infer": {
            "post": _oip(
                "Inference on a model version",
                {"200": infer},
                params=[_NAME, _VERSION, _TRACE_LEVEL],
                body=infer_body,
            )
        },
        "/v2/repository/index": {
            "post": _oip(
                "Model repository index: every served model's state (read scope); "
                '{"ready": true} lists only ready ones',
                {"200": _json(_ref("RepositoryIndex"), "models with state and reason")},
                body=optional_body,
            )
        },
        "/v2/repository/models/{name}/load": {
            "post": _oip(
                "Load a model: give an unloaded one its instances back and wait until one is "
                "ready (admin)",
                {"200": _EMPTY},
                params=[_NAME],
                body=optional_body,
            )
        },
        "/v2/repository/models/{name}/unload": {
            "post": _oip(
                "Unload a model: scale it to zero; it answers not ready until loaded (admin)",
                {"200": _EMPTY},
                params=[_NAME],
                body=optional_body,
            )
        },
        f"{shm}/status": {
            "get": _oip(
                "This token's system shared-memory regions (loopback only)", {"200": shm_status}
            )
        },
        f"{shm}/region/{{region}}/status": {
            "get": _oip("One registered region", {"200": shm_status}, params=[_REGION])
        },
        f"{shm}/region/{{region}}/register": {
            "post": _oip(
                "Register a window of a POSIX shared-memory object (loopback, invoke scope)",
                {"200": _EMPTY},
                params=[_REGION],
                body=register_body,
            )
        },
        f"{shm}/region/{{region}}/unregister": {
            "post": _oip("Unregister a region", {"200": _EMPTY}, params=[_REGION])
        },
        f"{shm}/unregister": {
            "post": _oip("Unregister all of this token's regions", {"200": _EMPTY})
        },
        f"{cuda}/status": {
            "get": _oip(
                "This token's CUDA shared-memory regions (loopback only)", {"200": cuda_status}
            )
        },
        f"{cuda}/region/{{region}}/status": {
            "get": _oip("One registered CUDA region", {"200": cuda_status}, params=[_REGION])
        },
        f"{cuda}/region/{{region}}/register": {
            "post": _oip(
                "Register device memory by CUDA IPC handle (loopback, invoke scope; 400 where "
                "the gateway cannot load the CUDA driver)",
                {"200": _EMPTY},
                params=[_REGION],
                body=cuda_body,
            )
        },
        f"{cuda}/region/{{region}}/unregister": {
            "post": _oip("Unregister a CUDA region", {"200": _EMPTY}, params=[_REGION])
        },
        f"{cuda}/unregister": {
            "post": _oip("Unregister all of this token's CUDA regions", {"200": _EMPTY})
        },
    }


def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "trims gateway",
            "version": __version__,
            "description": "Deploy and invoke inference functions; the Open Inference Protocol "
            "is under /v2.",
        },
        "paths": _paths(),
        "components": {
            "schemas": {**_SCHEMAS, "FunctionSpec": _function_spec_schema()},
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "Scopes: admin, read, invoke:<function>, invoke:*, trace, "
                    "trace:<function>. Without "
                    "a tokens file the gateway generates an admin token in <state dir>/auth/"
                    "admin-token; callers without a token have the gateway's anonymous scopes.",
                }
            },
        },
    }
