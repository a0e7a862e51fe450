"""The error middleware: every failure leaves the gateway as ``{"error": {"code", "message"}}``.

Statuses come from the one table :data:`trims.errors.HTTP_STATUS`; aiohttp's own HTTP errors
(unknown route, wrong method, body too large) are given the same JSON shape. Under ``/v2`` (the
Open Inference Protocol) the body is the KServe V2 one instead, ``{"error": "<message>"}``: the
same status and message, chosen by the path prefix alone.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

from trims.errors import HTTP_STATUS, QueueFull, RetryableError, TrimsError

log = logging.getLogger(__name__)

_AIOHTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    413: "too_large",
    415: "unsupported_media_type",
    429: "queue_full",
    503: "unavailable",
    504: "timeout",
}


def is_oip(path: str) -> bool:
    """Whether ``path`` is under the Open Inference Protocol's ``/v2``."""
    return path == "/v2" or path.startswith("/v2/")


def error_parts(
    status: int,
    code: str,
    message: str,
    *,
    details: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    oip: bool = False,
) -> tuple[int, dict[str, str], bytes]:
    """The error answer's status, headers and body; ``oip``: the Open Inference Protocol's
    ``{"error": "<message>"}``."""
    error: dict[str, Any] | str
    if oip:
        error = message
    else:
        error = {"code": code, "message": message}
        if details:
            error["details"] = details
    body = json.dumps({"error": error}).encode()
    return status, {**(headers or {}), "Content-Type": "application/json"}, body


def parts_response(parts: tuple[int, dict[str, str], bytes]) -> web.Response:
    """:func:`error_parts` (or :func:`trims_error_parts`) as a response."""
    status, headers, body = parts
    return web.Response(status=status, body=body, headers=headers)


def trims_error_parts(err: TrimsError, *, oip: bool = False) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and JSON body for a trims error; 429 carries ``Retry-After``, and
    so does any other retryable refusal that says when to retry (``retry_after_s``)."""
    headers: dict[str, str] = {}
    if isinstance(err, QueueFull) or (
        isinstance(err, RetryableError) and "retry_after_s" in err.details
    ):
        headers["Retry-After"] = str(int(err.details.get("retry_after_s", 1)))
    if err.code == "unauthorized":
        headers["WWW-Authenticate"] = 'Bearer realm="trims"'
    details = {k: v for k, v in err.details.items() if _jsonable(v)}
    return error_parts(
        HTTP_STATUS.get(err.code, 500),
        err.code,
        err.message,
        details=details,
        headers=headers,
        oip=oip,
    )


def trims_error_response(err: TrimsError, *, oip: bool = False) -> web.Response:
    """The JSON answer for a trims error (see :func:`trims_error_parts`)."""
    return parts_response(trims_error_parts(err, oip=oip))


def _jsonable(value: Any) -> bool:
    return isinstance(value, str | int | float | bool | list | dict) or value is None


def log_trims_error(method: str, path: str, err: TrimsError) -> None:
    """Server-side failures are logged (an internal one with its traceback); refusals are not."""
    if err.http_status >= 500 and err.code != "internal":
        log.info("%s %s answered %s: %s", method, path, err.code, err.message)
    elif err.code == "internal":
        log.exception("%s %s failed", method, path)


def unexpected_error_parts(*, oip: bool = False) -> tuple[int, dict[str, str], bytes]:
    """The answer to a failure the gateway did not expect (a bug; the caller logs it)."""
    return error_parts(
        500, "internal", "the gateway failed unexpectedly; see its log and report a bug", oip=oip
    )


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except TrimsError as e:
        log_trims_error(request.method, request.path, e)
        return trims_error_response(e, oip=is_oip(request.path))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = _AIOHTTP_CODES.get(e.status, "bad_request" if e.status < 500 else "internal")
        message = e.text if e.text and not e.text.startswith(str(e.status)) else e.reason
        if e.status == 404:
            message = f"no route for {request.method} {request.path}; see /openapi.json"
        elif e.status == 405:
            message = f"{request.method} is not allowed on {request.path}; see /openapi.json"
        elif e.status == 413:
            message = f"request body is larger than the gateway limit: {e.reason}"
        headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
        oip = is_oip(request.path)
        return parts_response(error_parts(e.status, code, message, headers=headers, oip=oip))
    except Exception:
        log.exception("%s %s failed with an unexpected error", request.method, request.path)
        return parts_response(unexpected_error_parts(oip=is_oip(request.path)))
