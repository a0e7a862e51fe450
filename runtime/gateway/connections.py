"""Connection limits in front of aiohttp: a deadline for the request head, per-peer caps.

aiohttp reads request heads for as long as a client cares to send them, so 300 connections
that each send ``GET / HTTP/1.1\\r\\nX-a: `` and then a byte now and then (slowloris) hold 300
file descriptors forever. :class:`GuardedTCPSite` binds like ``web.TCPSite`` but wraps each
accepted connection's aiohttp protocol in a :class:`_GuardedProtocol` that

* answers 503 and closes a connection beyond ``max_connections_per_peer`` open from one peer
  address, or beyond ``max_connections`` in all, before aiohttp sees it;
* closes a connection whose first request head (up to the blank line) is not complete
  ``header_timeout_s`` after it was accepted.

Later requests on a kept-alive connection fall under aiohttp's keepalive timeout (its timer
is not reset by partial data), and a stalled body under the read helpers' stall timeout
(``trims.runtime.gateway.context``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web

from trims.runtime.settings import GatewaySettings

__all__ = ["ConnectionGuard", "GuardedTCPSite"]

log = logging.getLogger(__name__)

_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 38\r\n\r\ntoo many connections; close some first\n"
)
_HEAD_END = b"\r\n\r\n"


class ConnectionGuard:
    """Counts open connections per peer and hands out guarded protocols."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.header_timeout_s = settings.header_timeout_s
        self.per_peer = settings.max_connections_per_peer
        self.total = settings.max_connections
        self.open: Counter[str] = Counter()
        self.refused = 0
        self.timed_out = 0

    def admit(self, peer: str) -> bool:
        if self.open[peer] >= self.per_peer or sum(self.open.values()) >= self.total:
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                log.warning(
                    "connection from %s refused with 503: %d open from it (limit %d), %d in "
                    "all (limit %d); %d refused so far",
                    peer, self.open[peer], self.per_peer, sum(self.open.values()), self.total,
                    self.refused,
                )  # fmt: skip
            return False
        self.open[peer] += 1
        return True

    def release(self, peer: str) -> None:
        self.open[peer] -= 1
        if self.open[peer] <= 0:
            del self.open[peer]

    def factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _GuardedProtocol(self, inner())


class _GuardedProtocol(asyncio.Protocol):
    """Forwards every protocol event to aiohttp's handler; enforces the guard's limits."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self._guard = guard
        self._inner = inner
        self._peer: str | None = None
        self._transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        transport = cast(asyncio.Transport, transport)
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) else "unix"
        if not self._guard.admit(peer):
            transport.write(_REFUSED)
            transport.close()
            return
        self._peer = peer
        self._transport = transport
        self._deadline = asyncio.get_running_loop().call_later(
            self._guard.header_timeout_s, self._head_too_slow
        )
        self._inner.connection_made(transport)

    def _head_too_slow(self) -> None:
        self._deadline = None
        if self._transport is not None and not self._transport.is_closing():
            self._guard.timed_out += 1
            log.info(
                "connection from %s closed: no complete request head in %.0fs",
                self._peer, self._guard.header_timeout_s,
            )  # fmt: skip
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._peer is None:
            return
        if self._deadline is not None:
            seen = self._tail + data
            if _HEAD_END in seen:
                self._deadline.cancel()
                self._deadline = None
                self._tail = b""
            else:
                self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._peer is None:
            return None
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._peer is None:
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._guard.release(self._peer)
        self._transport = None
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class GuardedTCPSite(web.TCPSite):
    """``web.TCPSite`` whose connections pass through a :class:`ConnectionGuard`."""

    __slots__ = ("_guard",)

    def __init__(self, runner: web.BaseRunner, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(runner, **kwargs)
        self._guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        listening = await asyncio.get_running_loop().create_server(
            self._guard.factory(server),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        self._server = listening
        self._bound_port = listening.sockets[0].getsockname()[1] if listening.sockets else None
