"""The ``Function`` custom resource: its definition (CRD), derived from the function spec schema.

A Function's ``spec`` is a trims function spec without ``name`` (the object's
``metadata.name`` is the function name) plus ``replicas``. The CRD's OpenAPI v3 schema is made
from :data:`trims.runtime.functions.schema.FUNCTION_SCHEMA` (generated from the spec's typed
model) by :func:`structural`, so the API server checks the same contract the gateway does; the
rules JSON Schema cannot state travel as the model's ``x-kubernetes-validations`` CEL rules.
``helm/trims/crds/function.yaml`` is this CRD as YAML (``trims operator crd`` writes it; a test
keeps the two equal).
"""

from __future__ import annotations

import copy
from typing import Any

from trims.runtime.functions.schema import FUNCTION_SCHEMA

GROUP = "trims.io"
VERSION = "v1alpha1"
KIND = "Function"
PLURAL = "functions"
API_VERSION = f"{GROUP}/{VERSION}"

#: Not in a structural schema: documentation noise, and ``default``, which the API server would
#: write into every stored object.
_DROP = ("$schema", "title", "$id", "default")
_CEL = "x-kubernetes-validations"

#: Columns ``kubectl get functions`` shows.
PRINTER_COLUMNS = [
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": ".status.conditions[?(@.type=='Ready')].status",
    },
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Image", "type": "string", "jsonPath": ".status.image"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema (draft 2020-12) -> a Kubernetes structural OpenAPI v3.0 schema.

    Kubernetes wants a ``type`` on every node, no ``additionalProperties`` beside
    ``properties`` (unknown fields are pruned instead), int-or-string instead of ``oneOf`` over
    types (each branch's bounds kept on the node: ``minimum`` binds only integers, ``pattern``
    only strings), free-form objects marked ``x-kubernetes-preserve-unknown-fields``, the
    OpenAPI 3.0 boolean form of ``exclusiveMinimum``, and no ``propertyNames`` (the model states
    that rule again as a CEL rule in ``x-kubernetes-validations``, which is kept).
    """
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {name: structural(sub) for name, sub in value.items()}
        elif key == "items":
            out[key] = structural(value)
        elif key == "additionalProperties":
            if isinstance(value, dict):
                out[key] = structural(value)
        elif key == "exclusiveMinimum":
            out["minimum"] = value
            out["exclusiveMinimum"] = True
        elif key == "oneOf" and all("type" in branch for branch in value):
            types = {branch["type"] for branch in value}
            if types <= {"integer", "string"}:
                out["x-kubernetes-int-or-string"] = True
                for branch in value:
                    out.update({k: v for k, v in branch.items() if k != "type"})
            else:
                raise ValueError(f"cannot express oneOf over types {sorted(types)} structurally")
        elif key == "propertyNames":
            if _CEL not in schema:
                raise ValueError(
                    "cannot express propertyNames structurally: give the field a CEL rule "
                    "(trims.runtime.functions.validation.cel_rule) that checks its keys"
                )
        else:
            out[key] = copy.deepcopy(value)
    if out.get("type") == ["string", "number"]:
        out["type"] = "string"
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    free_form = "properties" not in out and "additionalProperties" not in out
    if out.get("type") == "object" and free_form:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def function_spec_schema() -> dict[str, Any]:
    """The schema of a Function's ``spec``: the function spec less ``name``, plus replicas."""
    schema = structural(FUNCTION_SCHEMA)
    schema["properties"].pop("name")
    schema["required"] = [r for r in schema.get("required", []) if r != "name"]
    if not schema["required"]:
        schema.pop("required")
    schema["properties"]["replicas"] = {
        "type": "integer",
        "minimum": 0,
        "description": "worker pods to keep (default: max(1, scaling.min_instances))",
    }
    return schema


def name_rule() -> dict[str, str]:
    """The function name rule on ``metadata.name`` (the API server's own check allows dots and
    253 characters; a function name is a DNS label), as CEL at the schema's root."""
    pattern = FUNCTION_SCHEMA["properties"]["name"]["pattern"]
    return {
        "rule": f"self.metadata.name.matches('{pattern}')",
        "message": "metadata.name: a function name is 1-63 lowercase letters, digits or '-', "
        "starting and ending with a letter or digit",
    }


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition of ``functions.trims.io``."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["fn"],
                "categories": ["trims"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A trims function: code, models, resources, scaling.",
                            "required": ["spec"],
                            "x-kubernetes-validations": [name_rule()],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": function_spec_schema(),
                                "status": {
                                    "type": "object",
                                    "x-kubernetes-preserve-unknown-fields": True,
                                },
                            },
                        }
                    },
                }
            ],
        },
    }
