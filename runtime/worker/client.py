"""The caller's side of the wire protocol: one multiplexed connection to one worker.

``connect`` waits for the worker's HELLO; ``request`` sends a frame and awaits the frame with
the same id. When the stream ends, every waiting request fails with :class:`ConnectionLost`
(the instance turns that into an UpstreamError naming why the process died).

Note [coalesced writes]: uvloop writes to the socket at once on every ``writelines``, so N
requests started in one event-loop iteration would cost N ``sendmsg`` calls. Frames are
queued instead and written together by one callback at the end of the iteration
(:class:`~trims.runtime.wire.FrameWriter`): one system call per iteration whatever the
concurrency, and at concurrency 1 a delay of one loop callback (microseconds).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any, cast

from trims.errors import ProtocolError, UpstreamError, ValidationError
from trims.runtime.wire import META_TRACE, Frame, FrameReader, FrameWriter, Kind, encode_frame


class ConnectionLost(Exception):
    """The worker closed the stream (it exited, crashed or was killed)."""


class _ClientProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self._reader = FrameReader()
        self.transport: asyncio.Transport | None = None
        self.writer = FrameWriter()
        #: The worker's latest HELLO (None: none yet); a standby says two (wire.py).
        self.last_hello: dict[str, Any] | None = None
        #: Resolved (and replaced) on every HELLO and when the stream fails.
        self.hello_changed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.error: Exception | None = None
        self.pending: dict[int, asyncio.Future[Frame]] = {}
        self.closed = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.writer.attach(self.transport)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._reader.feed(data)
        except ProtocolError as e:
            self._fail(ConnectionLost(f"worker sent a malformed frame: {e}"))
            assert self.transport is not None
            self.transport.close()
            return
        for frame in frames:
            if frame.kind is Kind.HELLO:
                self.last_hello = frame.meta
                self._hello_changed()
                continue
            fut = self.pending.pop(frame.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.writer.detach()
        self._fail(ConnectionLost(str(exc) if exc else "worker closed the connection"))
        self.closed.set()

    def _hello_changed(self) -> None:
        done, self.hello_changed = self.hello_changed, asyncio.get_running_loop().create_future()
        done.set_result(None)

    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
            self._hello_changed()
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(error)


class WorkerConnection:
    def __init__(self, protocol: _ClientProtocol) -> None:
        self._p = protocol
        self._next_id = 1

    @classmethod
    async def open(cls, address: str) -> WorkerConnection:
        """Connect to 'unix:PATH' or 'tcp:HOST:PORT' (OSError if nothing listens yet)."""
        loop = asyncio.get_running_loop()
        scheme, _, rest = address.partition(":")
        if scheme == "unix":
            _, protocol = await loop.create_unix_connection(_ClientProtocol, rest)
        elif scheme == "tcp":
            host, _, port = rest.rpartition(":")
            _, protocol = await loop.create_connection(_ClientProtocol, host.strip("[]"), int(port))
        else:
            raise ValidationError(f"worker address {address!r}: use unix:PATH or tcp:HOST:PORT")
        return cls(protocol)

    async def hello(self, past: str | None = None) -> dict[str, Any]:
        """The worker's latest HELLO, ``{"state": "ready"|"failed"|"standby", "reason"?, "pid",
        ...}``, once there is one whose state is not ``past`` (``past="standby"``: the HELLO
        an activated standby says after its init). ConnectionLost if the stream ends first."""
        p = self._p
        while True:
            last = p.last_hello
            if last is not None and last.get("state") != past:
                return last
            if p.error is not None:
                raise p.error
            await asyncio.shield(p.hello_changed)

    def activate(self, trace: Mapping[str, str] | None = None) -> None:
        """Ask a standby worker to run its init (wire.py), its spans joining ``trace`` (W3C
        headers); its next HELLO says how it went."""
        if self._p.transport is None:
            raise ConnectionLost("worker connection is closed")
        self._p.writer.send(
            encode_frame(0, Kind.ACTIVATE, {META_TRACE: dict(trace)} if trace else None)
        )

    async def wait_closed(self) -> None:
        await self._p.closed.wait()

    async def request(
        self, kind: Kind, meta: Mapping[str, Any] | None, body: bytes, timeout: float
    ) -> Frame:
        """Send one request and wait for its reply frame (REPLY or ERROR).

        TimeoutError after ``timeout`` seconds (a CANCEL is sent to the worker);
        ConnectionLost if the worker goes away first.
        """
        transport = self._p.transport
        if transport is None:
            raise ConnectionLost("worker connection is closed")
        rid = self._next_id
        self._next_id = rid + 1 if rid < 0xFFFFFFFF else 1
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Frame] = loop.create_future()
        self._p.pending[rid] = fut
        self._p.writer.send(encode_frame(rid, kind, meta, body))
        # A timer on the future itself: cheaper than asyncio.wait_for on this hot path.
        timer = loop.call_later(timeout, _expire, fut)
        try:
            return await fut
        except (TimeoutError, asyncio.CancelledError):
            self._p.pending.pop(rid, None)
            if self._p.transport is not None:
                self._p.writer.send(encode_frame(rid, Kind.CANCEL))
            raise
        finally:
            timer.cancel()

    def close(self) -> None:
        if self._p.transport is not None:
            self._p.writer.flush()
            self._p.transport.close()


def _expire(fut: asyncio.Future[Frame]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


def raise_for_error(frame: Frame) -> None:
    """Re-raise an ERROR frame as the trims error it names."""
    if frame.kind is Kind.ERROR:
        from trims.errors import error_from_code

        raise error_from_code(
            str(frame.meta.get("code", "upstream")), str(frame.meta.get("message", ""))
        )
    if frame.kind is not Kind.REPLY:
        raise UpstreamError(f"worker answered a request with a {frame.kind.name} frame")


async def close_quietly(conn: WorkerConnection | None) -> None:
    if conn is None:
        return
    conn.close()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(conn.wait_closed(), 1.0)
