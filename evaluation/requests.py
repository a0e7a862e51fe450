"""The first check of a benchmark function's request, shared by the analyses, trace and
evaluate functions: no field the function does not know, and each given field of its types.

Bounds and names stay with each function; this only refuses what no function accepts.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from trims.errors import ValidationError

__all__ = ["check_type", "typed_fields"]


def check_type(key: str, value: Any, types: tuple[type, ...]) -> None:
    """ValidationError naming ``key`` unless ``value`` is one of ``types``."""
    # bool is an int in Python, but "threads": true is a mistake
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = " or ".join("object" if t is dict else t.__name__ for t in types)
        raise ValidationError(f"setting {key!r} must be {names}, got {value!r}", field=key)


def typed_fields(
    body: Mapping[str, Any], fields: Mapping[str, tuple[type, ...]], *, also: Collection[str] = ()
) -> dict[str, Any]:
    """The given ``fields`` of ``body``, each type-checked; ValidationError for a field that is
    neither in ``fields`` nor in ``also`` (names the function reads itself)."""
    unknown = sorted(set(body) - set(fields) - set(also))
    if unknown:
        raise ValidationError(f"unknown settings {unknown}; a request may give {sorted(fields)}")
    out: dict[str, Any] = {}
    for key, types in fields.items():
        if key in body:
            check_type(key, body[key], types)
            out[key] = body[key]
    return out
