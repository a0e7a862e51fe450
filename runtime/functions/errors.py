"""Errors a handler raises on purpose: the caller's request is wrong, not the function.

::

    from trims.runtime.functions import ClientError

    def handler(request, ctx):
        texts = request.json().get("texts")
        if not isinstance(texts, list) or not texts:
            raise ClientError("'texts' must be a non-empty list of strings", status=422)

The gateway answers ``status`` with the message in its usual error body
(``{"error": {"code": "invalid", "message": "..."}}``) instead of 502, counts the request
under that status, and keeps the instance. Any other exception a handler raises is the
function's failure: 502 with the exception's type and message.

The worker translates a ClientError into the request error of that status
(:func:`ClientError.to_error`); it crosses to the gateway as an ``ERROR`` frame's code, so the
wire format stays as it is.
"""

from __future__ import annotations

from trims.errors import (
    AlreadyExists,
    NotFound,
    PayloadTooLarge,
    RequestError,
    ValidationError,
)

__all__ = ["CLIENT_STATUSES", "ClientError"]

#: HTTP status -> the request error the gateway answers it with.
_ERRORS: dict[int, type[RequestError]] = {
    400: RequestError,
    404: NotFound,
    409: AlreadyExists,
    413: PayloadTooLarge,
    422: ValidationError,
}
#: The statuses a handler may answer with a ClientError.
CLIENT_STATUSES = tuple(sorted(_ERRORS))


class ClientError(Exception):
    """The request cannot be served as sent: answer ``status`` (400 by default, or 404, 409,
    413, 422) with ``message``, which should say what to change."""

    def __init__(self, message: str, status: int = 400) -> None:
        if status not in _ERRORS:
            raise ValueError(
                f"ClientError status {status!r}: use one of {', '.join(map(str, CLIENT_STATUSES))}"
            )
        super().__init__(message)
        self.message = message
        self.status = status

    def to_error(self) -> RequestError:
        """The trims request error the gateway answers with this status and message."""
        return _ERRORS[self.status](self.message)
