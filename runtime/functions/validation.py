"""Typed models to trims errors: pydantic's validation errors as :class:`ValidationError`.

The function spec (``spec.py``) is a pydantic model; this module turns what pydantic reports into
the message a user can act on, naming the field with its dotted path (``models[0].framework:
must be one of 'numpy', 'torch', 'onnxruntime' or 'mxnet', got 'caffe'``). It also holds the
small helpers those models share: a rule error that names the field it is about, and the
Kubernetes CEL rule a JSON Schema cannot express (``x-kubernetes-validations``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import pydantic
from pydantic_core import ErrorDetails, PydanticCustomError

from trims.errors import ValidationError

__all__ = ["cel_rule", "describe_errors", "hint", "rule_error"]

#: Pattern -> what a value must look like, for pattern mismatches (filled by :func:`hint`).
_HINTS: dict[str, str] = {}


def hint(pattern: str, what: str) -> str:
    """Register how a pattern reads to a user ("an environment variable name"); returns it."""
    _HINTS[pattern] = what
    return pattern


def rule_error(field: str, message: str) -> PydanticCustomError:
    """An error from a rule across fields, about ``field`` (relative to the model that checks)."""
    return PydanticCustomError("trims_rule", "{message}", {"message": message, "field": field})


def cel_rule(rule: str, message: str) -> dict[str, Any]:
    """``json_schema_extra`` for a rule JSON Schema cannot express: the CRD carries it as CEL,
    so the Kubernetes API server refuses what the model refuses."""
    return {"x-kubernetes-validations": [{"rule": rule, "message": message}]}


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if part == "[key]":
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _fields(model: Any, loc: tuple[int | str, ...]) -> list[str]:
    """The field names (with validation aliases) the dataclass at ``loc`` accepts."""
    for part in loc:
        if isinstance(part, int):
            continue
        field = next((f for f in dataclasses.fields(model) if f.name == part), None)
        if field is None:
            return []
        model = _dataclass_in(typing.get_type_hints(model)[field.name])
        if model is None:
            return []
    names = []
    for name, info in model.__pydantic_fields__.items():
        names.append(name)
        alias = info.validation_alias
        if isinstance(alias, pydantic.AliasChoices):
            names += [c for c in alias.choices if isinstance(c, str) and c != name]
    return sorted(names)


def _dataclass_in(tp: Any) -> Any:
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp
    if typing.get_origin(tp) in (tuple, typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            found = _dataclass_in(arg)
            if found is not None:
                return found
    return None


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _what(error: ErrorDetails, model: Any) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    value = error.get("input")
    if kind == "string_pattern_mismatch":
        return "must be " + _HINTS.get(ctx["pattern"], f"a string matching {ctx['pattern']}")
    if kind in ("greater_than_equal", "greater_than"):
        sign = ">=" if kind == "greater_than_equal" else ">"
        bound = ctx["ge" if kind == "greater_than_equal" else "gt"]
        noun = "an integer " if isinstance(value, int) and isinstance(bound, int) else ""
        return f"must be {noun}{sign} {bound}"
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}"
    if kind == "string_too_long":
        return f"must be at most {ctx['max_length']} characters"
    if kind == "too_long":
        return f"must have at most {ctx['max_length']} entries"
    if kind == "too_short":
        return "must not be empty"
    return _MESSAGES.get(kind, error["msg"])


_MESSAGES = {
    "missing": "is required",
    # every string in a spec is non-empty; the one that may be empty (an env value) says so
    "string_type": "must be a non-empty string",
    "string_too_short": "must be a non-empty string",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
    "dict_type": "must be an object",
    "dataclass_type": "must be an object",
    "list_type": "must be a list",
    "tuple_type": "must be a list",
}


def describe_errors(error: pydantic.ValidationError, model: Any, root: str = "") -> ValidationError:
    """The first error pydantic found in validating ``model``, as a trims ValidationError;
    ``root`` names a value validated alone (its path is then empty)."""
    first = error.errors(include_url=False)[0]
    loc = (root, *first["loc"]) if root else first["loc"]
    kind = first["type"]
    if kind == "trims_rule":
        ctx = first.get("ctx") or {}
        loc = (*loc, *str(ctx["field"]).split(".")) if ctx.get("field") else loc
        path = _path(loc)
        return ValidationError(f"{path}: {ctx['message']}", field=path)
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        path = _path(loc)
        allowed = ", ".join(_fields(model, loc[:-1]))
        return ValidationError(f"{path}: unknown field; allowed: {allowed}", field=path)
    path = _path(loc)
    what = _what(first, model)
    if kind == "missing" or repr(first.get("input")) in what:
        return ValidationError(f"{path}: {what}", field=path)
    return ValidationError(f"{path}: {what}, got {_shown(first.get('input'))}", field=path)
