"""Bearer tokens with scopes, and what a caller without a token may do.

A request names a token in ``Authorization: Bearer <secret>``. The secret is compared with every
configured token by :func:`hmac.compare_digest` (no early exit, so timing says nothing about
which prefix matched) and is never logged: logs and errors name the token by its ``name``.

Scopes: ``admin`` may do everything; ``read`` may list and get functions, pipelines and
invocations; ``invoke:<function>`` may invoke that function (and its models over the Open
Inference Protocol); ``invoke:*`` may invoke any function; ``trace`` may ask any function it may
invoke for a trace (``trims-trace-level``: profiling costs the instance time) and read the kept
traces, ``trace:<function>`` the same for one function. Reading with a token needs any valid
token. A request without an ``Authorization`` header has the gateway's ``anonymous_scopes``
(never admin); when it needs more, the answer is 401 naming the admin token file, if any.
Authentication is off only when the settings say so explicitly (``--no-auth``).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path

from aiohttp import web

from trims.errors import PermissionDenied, Unauthorized
from trims.runtime.settings import Token

__all__ = ["Authenticator", "may_invoke", "may_trace"]


class Authenticator:
    """Finds the token of a request and checks its scopes."""

    def __init__(
        self,
        tokens: Iterable[Token],
        *,
        enabled: bool = True,
        anonymous_scopes: frozenset[str] = frozenset(),
        token_file: Path | None = None,
    ) -> None:
        self._tokens = tuple(tokens)
        self._secrets = tuple(t.secret.encode() for t in self._tokens)
        self._enabled = enabled
        self._anonymous = Token("anonymous-caller", anonymous_scopes, "anonymous")
        self._token_file = token_file

    @property
    def enabled(self) -> bool:
        return self._enabled

    def is_anonymous(self, token: Token | None) -> bool:
        """Whether :meth:`authenticate`'s answer stands for a caller without a token: the
        anonymous token, or None (authentication off)."""
        return token is None or token is self._anonymous

    def _missing(self, what: str) -> Unauthorized:
        where = (
            f"the admin token is in {self._token_file} (readable by the user running the gateway); "
            if self._token_file is not None
            else ""
        )
        return Unauthorized(
            f"{what} needs a token: {where}send it as 'Authorization: Bearer <token>' "
            "(the trims CLI reads --token, $TRIMS_TOKEN or that file)"
        )

    def authenticate(self, request: web.Request) -> Token | None:
        """The request's token (the anonymous one without a header); None when auth is off.

        Raises Unauthorized for a malformed header or an unknown secret.
        """
        return self.token_for(request.headers.get("Authorization"))

    def token_for(self, header: str | None) -> Token | None:
        """The token an ``Authorization`` header names (see :meth:`authenticate`)."""
        if not self._enabled:
            return None
        if header is None:
            return self._anonymous
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise self._missing("this gateway")
        presented = secret.strip().encode()
        found: Token | None = None
        for token, expected in zip(self._tokens, self._secrets, strict=True):
            if hmac.compare_digest(presented, expected) and found is None:
                found = token
        if found is None:
            raise Unauthorized("the bearer token is not known to this gateway; check it")
        return found

    def _refuse(self, token: Token, what: str, scope: str) -> Exception:
        if token is self._anonymous:
            return self._missing(what)
        return PermissionDenied(f"token {token.name!r} lacks the {scope} scope {what} needs")

    def require_admin(self, request: web.Request) -> None:
        token = self.authenticate(request)
        if token is not None and "admin" not in token.scopes:
            raise self._refuse(token, "this operation (deploy, update or delete)", "admin")

    def require_any(self, request: web.Request) -> None:
        """Reading: any valid token, or an anonymous caller with the ``read`` scope."""
        token = self.authenticate(request)
        if token is self._anonymous and not ({"read", "admin"} & token.scopes):
            raise self._missing("reading")

    def allows_invoke(self, header: str | None, function: str) -> bool:
        """Whether the caller with this ``Authorization`` header may invoke ``function``
        (:meth:`require_invoke` without the error: the invoke fast path asks it)."""
        try:
            token = self.token_for(header)
        except Unauthorized:
            return False
        return token is None or may_invoke(token, function)

    def require_invoke(self, request: web.Request, functions: Iterable[str]) -> None:
        token = self.authenticate(request)
        if token is None:
            return
        for function in functions:
            if not may_invoke(token, function):
                if token is self._anonymous:
                    raise self._missing(f"invoking {function}")
                raise PermissionDenied(
                    f"token {token.name!r} lacks scope invoke:{function} "
                    "(or invoke:*, or admin) to invoke this function"
                )

    def require_trace(self, request: web.Request, function: str | None) -> None:
        """Tracing ``function`` (None: any function, to look a trace up before its function is
        known): the ``trace`` or ``trace:<function>`` scope, or admin. Anonymous callers have
        it only when ``anonymous_scopes`` names it."""
        token = self.authenticate(request)
        if token is None:
            return
        allowed = (
            may_trace(token, function)
            if function is not None
            else may_trace(token, "") or any(s.startswith("trace:") for s in token.scopes)
        )
        if not allowed:
            what = f"tracing {function}" if function is not None else "reading traces"
            scope = f"trace:{function}" if function is not None else "trace"
            if token is self._anonymous:
                raise self._missing(what)
            raise PermissionDenied(
                f"token {token.name!r} lacks scope {scope} (or trace, or admin) for {what}: "
                "profiling costs the instance time, so tracing needs its own scope"
            )


def may_trace(token: Token, function: str) -> bool:
    scopes = token.scopes
    return "admin" in scopes or "trace" in scopes or f"trace:{function}" in scopes


def may_invoke(token: Token, function: str) -> bool:
    scopes = token.scopes
    return "admin" in scopes or "invoke:*" in scopes or f"invoke:{function}" in scopes
