"""The function spec as JSON Schema (draft 2020-12), generated from the typed model.

:data:`FUNCTION_SCHEMA` is what pydantic generates for :class:`~trims.runtime.functions.spec.
FunctionSpec`, made self-contained and plain by :func:`plain_schema`: references inlined, titles
dropped, an optional field shown as its type (omit it instead of writing null), a mapping's key
pattern as ``propertyNames``. The gateway's OpenAPI document uses it as is; the Function CRD
(``trims.operators.crd``) makes a Kubernetes structural schema of it.
"""

from __future__ import annotations

from typing import Any

import pydantic

from trims.runtime.functions.spec import FunctionSpec

__all__ = ["FUNCTION_SCHEMA", "plain_schema"]


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = _inline(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {**target, **{k: _inline(v, defs) for k, v in node.items() if k != "$ref"}}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties", "$defs"):
            out[key] = {name: _inline(sub, defs) for name, sub in value.items()}
        else:
            out[key] = _inline(value, defs)
    return out


def _plain(node: Any) -> Any:
    if isinstance(node, list):
        return [_plain(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "title":
            continue
        if key in ("properties", "patternProperties"):
            out[key] = {name: _plain(sub) for name, sub in value.items()}
        else:
            out[key] = _plain(value)
    branches = out.get("anyOf")
    if isinstance(branches, list) and {"type": "null"} in branches:
        rest = [b for b in branches if b != {"type": "null"}]
        out.pop("anyOf")
        if out.get("default", ...) is None:
            out.pop("default")
        out = {**rest[0], **out} if len(rest) == 1 else {"anyOf": rest, **out}
    pattern_properties = out.pop("patternProperties", None)
    if pattern_properties:
        ((pattern, values),) = pattern_properties.items()
        out["propertyNames"] = {"pattern": pattern}
        out["additionalProperties"] = values
    return out


def plain_schema(model: type[Any], title: str) -> dict[str, Any]:
    """The JSON Schema of a pydantic model or dataclass, self-contained and without noise."""
    schema = pydantic.TypeAdapter(model).json_schema()
    defs = schema.pop("$defs", {})
    body: dict[str, Any] = _plain(_inline(schema, defs))
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": title, **body}


FUNCTION_SCHEMA: dict[str, Any] = plain_schema(FunctionSpec, "FunctionSpec")
