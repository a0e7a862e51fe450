"""The gateway's JSON API, called with the browser user's token.

The UI is one more API client: it sends the user's bearer token (or none, for an anonymous
user) and the gateway checks the scopes exactly as for any other caller, so a page can never
do what the API would refuse that user. Errors come back as the gateway's ``{"error": {code,
message}}`` and are rebuilt into the :mod:`trims.errors` class they were (401, 403, 404, ...).

The API's address is the UI's ``api_url``, else the local address the page request arrived on
(the socket's, never the client-chosen Host header: a forged Host must not receive tokens).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
from aiohttp import web

from trims.errors import TrimsError, Unavailable, error_from_code, error_from_dict

__all__ = ["GatewayAPI"]

log = logging.getLogger(__name__)

#: seconds an API call may take; invocations are asynchronous, so every call is short
_TIMEOUT_S = 30.0


class GatewayAPI:
    """Calls the gateway API on behalf of a page request."""

    def __init__(self, base_url: str | None) -> None:
        self._base_url = base_url.rstrip("/") if base_url else None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_TIMEOUT_S))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def base_url(self, request: web.Request) -> str:
        if self._base_url is not None:
            return self._base_url
        transport = request.transport
        sockname = transport.get_extra_info("sockname") if transport is not None else None
        if not isinstance(sockname, tuple) or len(sockname) < 2:
            raise Unavailable(
                "the web UI cannot tell the gateway's address from this connection; "
                "configure its api_url"
            )
        host, port = str(sockname[0]), int(sockname[1])
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def call(
        self,
        request: web.Request,
        method: str,
        path: str,
        *,
        token: str | None,
        body: Any = None,
        params: dict[str, str] | None = None,
    ) -> Any:
        """The JSON answer of ``method path``; a non-2xx answer raises its trims error."""
        if self._session is None:
            raise Unavailable("the web UI is not started (its API client is closed)")
        headers = {"Accept": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        url = self.base_url(request) + path
        try:
            async with self._session.request(
                method, url, json=body, params=params, headers=headers
            ) as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as e:
            raise Unavailable(f"the gateway API at {url} did not answer: {e}") from e
        doc = _json(raw)
        if status < 300:
            return doc
        raise _error(status, doc)


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def _error(status: int, doc: Any) -> TrimsError:
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        return error_from_dict(doc["error"])
    codes = {401: "unauthorized", 403: "permission_denied", 404: "not_found", 503: "unavailable"}
    return error_from_code(codes.get(status, "internal"), f"the gateway API answered {status}")
