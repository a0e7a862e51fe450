"""The function spec as JSON Schema (draft 2020-12), for the gateway's OpenAPI document.

It states the same contract :func:`trims.runtime.functions.spec.parse_spec` enforces; the parser
stays the authority (it also checks cross-field rules and gives messages that name the field).
"""

from __future__ import annotations

from typing import Any

_SIZE: dict[str, Any] = {
    "oneOf": [
        {"type": "integer", "minimum": 1},
        {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*([kKmMgGtT]i?[bB]?|[bB])?\s*$"},
    ]
}
_TENSOR: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "datatype", "shape"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "datatype": {
            "enum": [
                "BOOL",
                "UINT8",
                "UINT16",
                "UINT32",
                "UINT64",
                "INT8",
                "INT16",
                "INT32",
                "INT64",
                "FP16",
                "FP32",
                "FP64",
                "BYTES",
            ]
        },
        "shape": {"type": "array", "items": {"type": "integer", "minimum": -1}},
    },
}

FUNCTION_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "FunctionSpec",
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "anyOf": [{"required": ["handler"]}, {"required": ["image"]}],
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"},
        "handler": {
            "type": "string",
            "description": "module:function; the module must be a file or package in code_dir "
            "(or one of the project's benchmark modules, trims.kernels.* / trims.evaluation.*)",
            "pattern": r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$",
        },
        "code_dir": {
            "type": "string",
            "description": "absolute directory holding the handler module; no '..', no system "
            "or trims directory",
            "pattern": "^/",
            "maxLength": 4096,
        },
        "image": {"type": "string", "minLength": 1},
        "executor": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,62}$"},
        "environment": {
            "type": "string",
            "description": "the Python environment the local executor runs the function in, by "
            "the name the gateway declares (--environment NAME=PYTHON); default: the gateway's",
            "pattern": "^[a-z][a-z0-9-]{0,62}$",
        },
        "models": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"},
                    "version": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"},
                    "source": {"type": "string", "minLength": 1},
                    "framework": {"enum": ["numpy", "torch", "onnxruntime", "mxnet"]},
                    "tier": {"enum": ["cpu", "gpu", "disk"]},
                    "alias": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"},
                },
            },
        },
        "resources": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "cpus": {"type": "number", "exclusiveMinimum": 0},
                "memory": _SIZE,
                "memory_bytes": _SIZE,
                "gpus": {"type": "integer", "minimum": 0},
            },
        },
        "scaling": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "min_instances": {"type": "integer", "minimum": 0},
                "max_instances": {"type": "integer", "minimum": 1},
                "concurrency": {"type": "integer", "minimum": 1},
                "queue_size": {"type": "integer", "minimum": 0},
                "idle_timeout_s": {"type": "number", "exclusiveMinimum": 0},
                "request_timeout_s": {"type": "number", "exclusiveMinimum": 0},
                "max_body_bytes": _SIZE,
            },
        },
        # Env keys are checked by the spec parser: a Kubernetes structural schema (the CRD is
        # generated from this one) cannot hold propertyNames.
        "env": {"type": "object", "additionalProperties": {"type": ["string", "number"]}},
        "config": {"type": "object"},
        "serves": {
            "type": "object",
            "additionalProperties": False,
            "required": ["inputs", "outputs"],
            "properties": {
                "inputs": {"type": "array", "minItems": 1, "items": _TENSOR},
                "outputs": {"type": "array", "minItems": 1, "items": _TENSOR},
                "platform": {"type": "string"},
                "versions": {"type": "array", "minItems": 1, "items": {"type": "string"}},
            },
        },
    },
}
