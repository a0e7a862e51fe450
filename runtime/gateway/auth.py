"""Bearer tokens with scopes.

A request names a token in ``Authorization: Bearer <secret>``. The secret is compared with every
configured token by :func:`hmac.compare_digest` (no early exit, so timing says nothing about
which prefix matched) and is never logged: logs and errors name the token by its ``name``.

Scopes: ``admin`` may do everything; ``invoke:<function>`` may invoke that function (and its
models over the Open Inference Protocol); ``invoke:*`` may invoke any function. Reading the
function list needs any valid token. With no tokens configured, authentication is off.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from aiohttp import web

from trims.errors import PermissionDenied, Unauthorized
from trims.runtime.settings import Token


class Authenticator:
    """Finds the token of a request and checks its scopes."""

    def __init__(self, tokens: Iterable[Token]) -> None:
        self._tokens = tuple(tokens)
        self._secrets = tuple(t.secret.encode() for t in self._tokens)

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def authenticate(self, request: web.Request) -> Token | None:
        """The request's token; None when authentication is off. Raises Unauthorized."""
        if not self._tokens:
            return None
        header = request.headers.get("Authorization", "")
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise Unauthorized(
                "send 'Authorization: Bearer <token>'; this gateway requires a token"
            )
        presented = secret.strip().encode()
        found: Token | None = None
        for token, expected in zip(self._tokens, self._secrets, strict=True):
            if hmac.compare_digest(presented, expected) and found is None:
                found = token
        if found is None:
            raise Unauthorized("the bearer token is not known to this gateway; check it")
        return found

    def require_admin(self, request: web.Request) -> None:
        token = self.authenticate(request)
        if token is not None and "admin" not in token.scopes:
            raise PermissionDenied(
                f"token {token.name!r} lacks the admin scope this operation needs"
            )

    def require_any(self, request: web.Request) -> None:
        self.authenticate(request)

    def require_invoke(self, request: web.Request, functions: Iterable[str]) -> None:
        token = self.authenticate(request)
        if token is None:
            return
        for function in functions:
            if not may_invoke(token, function):
                raise PermissionDenied(
                    f"token {token.name!r} lacks scope invoke:{function} "
                    "(or invoke:*, or admin) to invoke this function"
                )


def may_invoke(token: Token, function: str) -> bool:
    scopes = token.scopes
    return "admin" in scopes or "invoke:*" in scopes or f"invoke:{function}" in scopes
