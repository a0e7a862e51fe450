"""The HTTP side of the systems under test that call a gateway (function, text, pipeline).

LoadGen calls a system under test from its own threads, so :class:`GatewayClient` keeps one
aiohttp connection pool on a private event loop in a thread and offers blocking entry points
(:meth:`GatewayClient.call` runs a coroutine there). :func:`put_specs` deploys function and
pipeline specs with the admin token before a client exists; :func:`gateway_error` turns an
error answer into the ``trims.errors`` class it names.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Coroutine, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from trims.errors import ERROR_CODES, TrimsError, Unavailable, error_from_dict

if TYPE_CHECKING:
    import aiohttp

__all__ = ["GatewayClient", "gateway_error", "put_specs"]

_T = TypeVar("_T")


def gateway_error(status: int, body: bytes, doing: str) -> TrimsError:
    """The error a gateway answer carries (its ``trims.errors`` class), or a plain one."""
    try:
        error = json.loads(body)["error"]
        if isinstance(error, str):  # /v2 (Open Inference Protocol): {"error": "<message>"}
            by_status = {c.http_status: c for c in reversed(ERROR_CODES.values())}
            return by_status.get(status, TrimsError)(error)
        return error_from_dict(error)
    except (ValueError, KeyError, TypeError):
        text = body[:200].decode(errors="replace")
        return TrimsError(f"{doing}: the gateway answered {status}: {text}")


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def put_specs(url: str, specs: Iterable[tuple[str, Mapping[str, Any]]], token: str | None) -> None:
    """PUT each (path, spec) to the gateway at ``url``, in order (deploying replaces)."""
    headers = {"Content-Type": "application/json", **_auth(token)}
    base = url.rstrip("/")
    for path, spec in specs:
        request = urllib.request.Request(
            base + path, data=json.dumps(dict(spec)).encode(), method="PUT", headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                response.read()
        except urllib.error.HTTPError as e:
            raise gateway_error(e.code, e.read(), f"PUT {path}") from None
        except urllib.error.URLError as e:
            raise Unavailable(f"cannot reach the gateway at {url}: {e.reason}") from e


class GatewayClient:
    """A connection pool to one gateway on a private event loop thread; :meth:`close` it."""

    def __init__(
        self,
        url: str,
        *,
        name: str,
        token: str | None = None,
        connections: int = 8,
        timeout_s: float = 120.0,
    ) -> None:
        import aiohttp

        self.url = url.rstrip("/")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

        async def make_session() -> aiohttp.ClientSession:
            return aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=connections),
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                headers=_auth(token),
            )

        try:
            self.session = self.call(make_session())
        except BaseException:
            self._stop_loop()
            raise

    @property
    def open(self) -> bool:
        return self._thread.is_alive()

    def call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coro`` on the client's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def json(self, method: str, path: str) -> Any:
        """``method path`` answered as JSON (None for an empty body); errors raised."""
        async with self.session.request(method, self.url + path) as r:
            body = await r.read()
            if r.status >= 400:
                raise gateway_error(r.status, body, f"{method} {path}")
            return json.loads(body) if body else None

    def close(self) -> None:
        """Close the pool and stop the loop; idempotent."""
        if not self.open:
            return
        self.call(self.session.close())
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
