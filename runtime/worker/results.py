"""Turn what a handler returned into (status, headers, body) for the wire; reject the rest."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from trims.errors import UpstreamError
from trims.runtime.functions.context import Response

_OCTET = {"content-type": "application/octet-stream"}
_TEXT = {"content-type": "text/plain; charset=utf-8"}
_JSON = {"content-type": "application/json"}
_ACCEPTED = "bytes, str, a dict or list (JSON), trims.runtime.functions.Response or None"


def to_reply(function: str, result: Any) -> tuple[int, Mapping[str, str], bytes]:
    if isinstance(result, bytes):
        return 200, _OCTET, result
    if isinstance(result, str):
        return 200, _TEXT, result.encode()
    if isinstance(result, dict | list):
        try:
            return 200, _JSON, json.dumps(result, separators=(",", ":")).encode()
        except (TypeError, ValueError) as e:
            raise UpstreamError(
                f"handler of {function} returned a {type(result).__name__} that is not "
                f"JSON-serializable ({e})"
            ) from e
    if isinstance(result, Response):
        body = result.body
        if isinstance(body, str):
            body = body.encode()
        if not isinstance(body, bytes | bytearray | memoryview):
            raise UpstreamError(
                f"handler of {function} returned a Response whose body is a "
                f"{type(body).__name__}; use bytes or str"
            )
        if not 100 <= int(result.status) <= 599:
            raise UpstreamError(f"handler of {function} returned status {result.status}")
        return int(result.status), dict(result.headers), bytes(body)
    if isinstance(result, bytearray | memoryview):
        return 200, _OCTET, bytes(result)
    if result is None:
        return 204, {}, b""
    raise UpstreamError(
        f"handler of {function} returned a {type(result).__name__}; return {_ACCEPTED}"
    )


def check_outputs(function: str, result: Any) -> Mapping[str, Any]:
    """infer() must return a mapping of output name -> array."""
    import numpy as np

    if not isinstance(result, Mapping):
        raise UpstreamError(
            f"infer of {function} returned a {type(result).__name__}; return a dict of "
            "output name -> numpy array"
        )
    for name, value in result.items():
        if not isinstance(name, str) or not isinstance(value, np.ndarray | np.generic | list):
            raise UpstreamError(
                f"infer of {function} returned output {name!r} as a {type(value).__name__}; "
                "use numpy arrays"
            )
    return result
