"""Connection limits in front of aiohttp: a deadline for the request head, per-peer caps.

aiohttp reads request heads for as long as a client cares to send them, so 300 connections
that each send ``GET / HTTP/1.1\\r\\nX-a: `` and then a byte now and then (slowloris) hold 300
file descriptors forever. :class:`GuardedTCPSite` binds like ``web.TCPSite`` but wraps each
accepted connection's aiohttp protocol in a :class:`_GuardedProtocol` that

* answers 503 and closes a connection beyond ``max_connections_per_peer`` open from one peer,
  before aiohttp sees it;
* closes a connection whose first request head (up to the blank line) is not complete
  ``header_timeout_s`` after it was accepted.

Note [connection peers]: a peer is a local user for a loopback connection (``uid 1000``: the
kernel says who owns the caller's socket, asked once at accept, :mod:`trims.peer_cred`), else the
caller's address. Every local user reaches the gateway from 127.0.0.1, and one loopback user
may use all of 127.0.0.0/8: keyed by address, one user holding half-sent heads would take every
other local user's share, and one user on 16 addresses the total. A loopback connection whose
owner the kernel does not say counts under its address.

Note [reserved connections]: of ``max_connections``, ``connections_reserved`` are only for
connections that have sent a complete request head (those are being served); connections
still sending their first head, the only kind a slowloris holds, share the rest. A newcomer
that finds no room (that share full, or every connection taken) closes the oldest head-less
connection of the peer holding the most head-less connections, if that peer holds more of them
than the newcomer's own, and takes its place; otherwise it is refused with 503. So a client
that sends its request at once is served however many head-less connections others hold, a
connection being served is never closed for another, and peers evict only each other's
excess, never a fair share.

Later requests on a kept-alive connection fall under aiohttp's keepalive timeout (its timer
is not reset by partial data), and a stalled body under the read helpers' stall timeout
(``trims.runtime.gateway.context``).

Each admitted connection starts on the invoke fast path when there is one (Note [invoke fast
path] in ``fastpath.py``) and is handed to aiohttp's protocol, made only then, at its first
request the fast path does not answer; a request head still arriving at that moment gets
the same ``header_timeout_s`` as a connection's first.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web

from trims.peer_cred import peer_of
from trims.runtime.gateway.fastpath import HEAD_END, FastConnection, FastInvoke
from trims.runtime.settings import GatewaySettings

__all__ = ["ConnectionGuard", "GuardedTCPSite"]

log = logging.getLogger(__name__)

_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 38\r\n\r\ntoo many connections; close some first\n"
)


class ConnectionGuard:
    """Counts open connections per peer and hands out guarded protocols.

    ``fast``: the invoke fast path (Note [invoke fast path] in ``fastpath.py``); each
    connection starts on it and is handed to aiohttp at its first request the fast path does
    not answer. None: every connection is aiohttp's from the start.
    """

    def __init__(self, settings: GatewaySettings, fast: FastInvoke | None = None) -> None:
        self.header_timeout_s = settings.header_timeout_s
        self.keepalive_s = settings.keepalive_timeout_s
        self.per_peer = settings.max_connections_per_peer
        self.total = settings.max_connections
        #: Most connections still sending their first request head (Note [reserved
        #: connections]).
        self.headless_cap = settings.max_connections - settings.connections_reserved
        self.fast = fast
        #: Open connections by peer.
        self.open: Counter[str] = Counter()
        #: Connections still sending their first request head, by peer, oldest first.
        self.headless: dict[str, dict[_GuardedProtocol, None]] = {}
        self.open_total = 0
        self.headless_total = 0
        self.refused = 0
        #: Head-less connections closed to make room for a newcomer.
        self.evicted = 0
        self.timed_out = 0
        #: Connections the fast path gave to aiohttp.
        self.handed_over = 0
        #: Connections on the fast path now (closed at shutdown: aiohttp does not know them).
        self.fast_connections: set[FastConnection] = set()

    def admit(self, connection: _GuardedProtocol, peer: str) -> bool:
        """Count a new connection of ``peer`` (head-less), making room for it by closing
        another peer's oldest head-less one where needed; False: refuse it."""
        if self.open[peer] >= self.per_peer:
            return self._refuse(peer, f"{self.open[peer]} open from it (limit {self.per_peer})")
        if self.open_total >= self.total or self.headless_total >= self.headless_cap:
            victim = self._victim(peer)
            if victim is None:
                return self._refuse(
                    peer,
                    f"{self.open_total} open in all (limit {self.total}), "
                    f"{self.headless_total} still sending a request head (limit "
                    f"{self.headless_cap}), none of another peer's to close",
                )
            self._evict(victim)
        self.open[peer] += 1
        self.open_total += 1
        self.headless.setdefault(peer, {})[connection] = None
        self.headless_total += 1
        return True

    def _refuse(self, peer: str, why: str) -> bool:
        self.refused += 1
        if self.refused == 1 or self.refused % 1000 == 0:
            log.warning(
                "connection from %s refused with 503: %s; %d refused so far",
                peer, why, self.refused,
            )  # fmt: skip
        return False

    def _victim(self, peer: str) -> _GuardedProtocol | None:
        """The oldest head-less connection of the peer holding the most, if that is more than
        ``peer`` holds."""
        if not self.headless:
            return None
        most = max(self.headless.values(), key=len)
        if len(most) <= len(self.headless.get(peer, ())):
            return None
        return next(iter(most))

    def _evict(self, victim: _GuardedProtocol) -> None:
        self.evicted += 1
        if self.evicted == 1 or self.evicted % 1000 == 0:
            log.warning(
                "connection from %s closed to make room: it had sent no complete request head "
                "while its peer held the most such connections; %d closed so far",
                victim.peer, self.evicted,
            )  # fmt: skip
        self.release(victim)
        victim.abort()

    def headed(self, connection: _GuardedProtocol) -> None:
        """``connection`` sent its first complete request head."""
        waiting = self.headless.get(connection.peer)
        if waiting is None or connection not in waiting:
            return
        del waiting[connection]
        self.headless_total -= 1
        if not waiting:
            del self.headless[connection.peer]

    def release(self, connection: _GuardedProtocol) -> None:
        """``connection`` is gone (or being closed); counting it again is a no-op."""
        if not connection.counted:
            return
        connection.counted = False
        self.headed(connection)
        peer = connection.peer
        self.open_total -= 1
        self.open[peer] -= 1
        if self.open[peer] <= 0:
            del self.open[peer]

    def factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _GuardedProtocol(self, inner)

    def close_fast_connections(self) -> None:
        """Shutting down: close each fast-path connection once its running request is answered."""
        for connection in list(self.fast_connections):
            connection.close_when_idle()


class _GuardedProtocol(asyncio.Protocol):
    """Enforces the guard's limits; serves the connection on the fast path, then (or from the
    start) forwards every protocol event to aiohttp's handler, made when first needed."""

    def __init__(self, guard: ConnectionGuard, make_inner: Callable[[], asyncio.Protocol]) -> None:
        self._guard = guard
        self._make_inner = make_inner
        self._inner: asyncio.Protocol | None = None
        self._fast: FastConnection | None = None
        #: Whom the guard counts this connection under ("" until it is admitted).
        self.peer = ""
        #: Whether the guard counts it (admitted and not yet released).
        self.counted = False
        self._admitted = False
        self._headless = True
        self._transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        transport = cast(asyncio.Transport, transport)
        self.peer = peer_of(transport)
        if not self._guard.admit(self, self.peer):
            transport.write(_REFUSED)
            transport.close()
            return
        self.counted = self._admitted = True
        self._transport = transport
        self._arm_deadline()
        guard = self._guard
        if guard.fast is not None:
            self._fast = FastConnection(transport, guard.fast, self._hand_over, guard.keepalive_s)
            guard.fast_connections.add(self._fast)
        else:
            self._start_inner(transport)

    def abort(self) -> None:
        """Close at once (the guard made room for another connection)."""
        if self._transport is not None:
            self._transport.abort()

    def _arm_deadline(self) -> None:
        self._deadline = asyncio.get_running_loop().call_later(
            self._guard.header_timeout_s, self._head_too_slow
        )

    def _start_inner(self, transport: asyncio.Transport) -> asyncio.Protocol:
        inner = self._inner = self._make_inner()
        inner.connection_made(transport)
        return inner

    def _hand_over(self, pending: bytes) -> None:
        """The fast path gives the connection to aiohttp with the bytes it has not answered."""
        assert self._fast is not None and self._transport is not None
        self._guard.fast_connections.discard(self._fast)
        self._guard.handed_over += 1
        self._fast = None
        inner = self._start_inner(self._transport)
        if pending:
            if self._deadline is None and HEAD_END not in pending:
                # A request head still arriving: the same deadline as a connection's first.
                self._tail = pending[-3:]
                self._arm_deadline()
            inner.data_received(pending)

    def _head_too_slow(self) -> None:
        self._deadline = None
        if self._transport is not None and not self._transport.is_closing():
            self._guard.timed_out += 1
            log.info(
                "connection from %s closed: no complete request head in %.0fs",
                self.peer, self._guard.header_timeout_s,
            )  # fmt: skip
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        if self._deadline is not None:
            seen = self._tail + data
            if HEAD_END in seen:
                self._deadline.cancel()
                self._deadline = None
                self._tail = b""
                if self._headless:
                    self._headless = False
                    self._guard.headed(self)
            else:
                self._tail = seen[-3:]
        if self._fast is not None:
            self._fast.feed(data)
        elif self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._inner is None:
            return None  # the transport closes (as aiohttp's handler has it)
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._admitted:
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._guard.release(self)
        self._transport = None
        if self._fast is not None:
            self._guard.fast_connections.discard(self._fast)
            self._fast.connection_lost()
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._fast is not None:
            self._fast.pause_writing()
        elif self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._fast is not None:
            self._fast.resume_writing()
        elif self._inner is not None:
            self._inner.resume_writing()


class GuardedTCPSite(web.TCPSite):
    """``web.TCPSite`` whose connections pass through a :class:`ConnectionGuard`."""

    __slots__ = ("_guard",)

    def __init__(self, runner: web.BaseRunner, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(runner, **kwargs)
        self._guard = guard

    @property
    def guard(self) -> ConnectionGuard:
        return self._guard

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

    async def stop(self) -> None:
        self._guard.close_fast_connections()
        await super().stop()
