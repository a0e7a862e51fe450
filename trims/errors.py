"""The error tree shared by the daemon, the runtime and the CLI.

Split by what the caller should do, not by where the error happened::

    TrimsError                      (500) something unexpected; report a bug
    ├── RequestError                (400) fix the request and send it again
    │   ├── ProtocolError           (400) malformed frame, bad version, oversized length
    │   ├── ValidationError         (422) a field has the wrong type or value
    │   ├── NotFound                (404) no such model / function / lease
    │   ├── AlreadyExists           (409) a model or function of that name exists
    │   ├── PayloadTooLarge         (413) the body is larger than the limit
    │   └── CorruptModel            (422) a model file is truncated, unparsable or fails its digest
    ├── AccessError
    │   ├── Unauthorized            (401) no or unknown credentials
    │   └── PermissionDenied        (403) the credentials lack the scope for this operation
    ├── RetryableError              retry later; the same request may then succeed
    │   ├── ResourceExhausted       (507) a tier's budget is full and nothing can be evicted
    │   ├── QueueFull               (429) too many requests waiting; see Retry-After
    │   ├── Unavailable             (503) the daemon or an instance is not reachable / draining
    │   └── Timeout                 (504) the operation did not finish in time
    └── UpstreamError               (502) a function instance crashed or answered garbage

Every error has a stable string ``code`` that crosses process boundaries (protocol frames,
JSON bodies); :func:`error_from_code` rebuilds the class on the other side. Third-party errors
(CUDA, boto, docker, kubernetes) are translated at the boundary with ``raise ... from``, through
one declarative table per library (:class:`ErrorMap` rows, :func:`mapped_errors`; the shape of
httpx's ``map_exceptions``) and one status table for every HTTP-speaking service
(:func:`error_for_status`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar


class TrimsError(Exception):
    """Root of all trims errors. ``message`` says what happened and what to do about it."""

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        """The JSON form used in protocol frames and HTTP error bodies."""
        body: dict[str, Any] = {
            "code": self.code,
            "message": self.message,
            "retryable": self.retryable,
        }
        if self.details:
            body["details"] = self.details
        return body


class RequestError(TrimsError):
    code = "bad_request"
    http_status = 400


class ProtocolError(RequestError):
    code = "protocol"
    http_status = 400


class ValidationError(RequestError):
    code = "invalid"
    http_status = 422


class NotFound(RequestError):
    code = "not_found"
    http_status = 404


class AlreadyExists(RequestError):
    code = "already_exists"
    http_status = 409


class PayloadTooLarge(RequestError):
    code = "too_large"
    http_status = 413


class CorruptModel(RequestError):
    code = "corrupt_model"
    http_status = 422


class AccessError(TrimsError):
    code = "access"
    http_status = 403


class Unauthorized(AccessError):
    code = "unauthorized"
    http_status = 401


class PermissionDenied(AccessError):
    code = "permission_denied"
    http_status = 403


class RetryableError(TrimsError):
    code = "retryable"
    http_status = 503
    retryable = True


class ResourceExhausted(RetryableError):
    code = "resource_exhausted"
    http_status = 507


class QueueFull(RetryableError):
    code = "queue_full"
    http_status = 429


class Unavailable(RetryableError):
    code = "unavailable"
    http_status = 503


class Timeout(RetryableError):
    code = "timeout"
    http_status = 504


class UpstreamError(TrimsError):
    code = "upstream"
    http_status = 502


def _all_subclasses(cls: type[TrimsError]) -> list[type[TrimsError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


#: code -> class, the one table that maps errors across process boundaries.
ERROR_CODES: dict[str, type[TrimsError]] = {c.code: c for c in _all_subclasses(TrimsError)}

#: code -> HTTP status, the one table the gateway uses to answer errors.
HTTP_STATUS: dict[str, int] = {code: cls.http_status for code, cls in ERROR_CODES.items()}


def error_from_code(code: str, message: str, details: dict[str, Any] | None = None) -> TrimsError:
    """Rebuild an error received from another process; unknown codes become ``TrimsError``."""
    cls = ERROR_CODES.get(code, TrimsError)
    return cls(message, **(details or {}))


def error_from_dict(body: dict[str, Any]) -> TrimsError:
    """Inverse of :meth:`TrimsError.to_dict`."""
    details = body.get("details")
    return error_from_code(
        str(body.get("code", "internal")),
        str(body.get("message", "unknown error")),
        details if isinstance(details, dict) else None,
    )


def error_for_status(status: int) -> type[TrimsError]:
    """The trims error for a remote service's HTTP(-like) refusal: what the caller should do
    about a 404 from the Kubernetes API, an S3 bucket or a model URL is the same."""
    if status in (404, 410):
        return NotFound
    if status in (401, 403):
        return PermissionDenied
    if status == 409:
        return AlreadyExists
    if status in (408, 429) or status >= 500:
        return Unavailable
    if 400 <= status < 500:
        return ValidationError
    return UpstreamError


@dataclass(frozen=True)
class ErrorMap:
    """One row of a library's error table: exceptions of ``types`` (for which ``when`` holds)
    become ``error`` (a class, or a function of the exception choosing one) with ``message``,
    formatted with ``{action}`` (what was being done) and ``{detail}`` (what the library said)."""

    types: type[BaseException] | tuple[type[BaseException], ...]
    error: type[TrimsError] | Callable[[Any], type[TrimsError]]
    message: str = "{action}: {detail}"
    when: Callable[[Any], bool] | None = None

    def matches(self, e: BaseException) -> bool:
        return isinstance(e, self.types) and (self.when is None or self.when(e))

    def build(self, e: BaseException, action: str, detail: str) -> TrimsError:
        cls: type[TrimsError] = self.error if isinstance(self.error, type) else self.error(e)
        return cls(self.message.format(action=action, detail=detail))


@contextlib.contextmanager
def mapped_errors(
    action: str, table: Sequence[ErrorMap], detail: Callable[[Any], str] = str
) -> Iterator[None]:
    """Translate the first matching row of ``table`` (others pass unchanged, trims errors too):
    ``with mapped_errors("create pod x", RULES): api.create(...)``."""
    try:
        yield
    except TrimsError:
        raise
    except Exception as e:
        for row in table:
            if row.matches(e):
                raise row.build(e, action, detail(e)) from e
        raise
