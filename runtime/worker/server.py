"""The worker's side of the wire protocol: accept connections, run requests, answer frames.

Lifecycle: ``start()`` binds the listen address (clients may connect at once) -> for a standby,
``set_standby()`` once prepared, then :attr:`activated` waits for a client's ACTIVATE ->
``set_ready()`` or ``set_failed(reason)`` once init has run (every connection, present or
future, then gets its HELLO) -> ``drain()`` refuses new requests and waits for the in-flight
ones -> ``close()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from trims.errors import ProtocolError, TrimsError, Unavailable, ValidationError
from trims.runtime.wire import META_TRACE, Frame, FrameReader, FrameWriter, Kind, encode_frame

log = logging.getLogger(__name__)

#: Runs one request frame; returns (meta, body) of the REPLY or raises (-> ERROR frame).
RequestRunner = Callable[[Frame], Awaitable[tuple[dict[str, Any], bytes]]]


@dataclass(frozen=True)
class ListenAddress:
    kind: str  # "unix" | "tcp"
    path: str = ""
    host: str = ""
    port: int = 0

    @classmethod
    def parse(cls, text: str) -> ListenAddress:
        """'unix:/run/w.sock' or 'tcp:0.0.0.0:8080'."""
        scheme, _, rest = text.partition(":")
        if scheme == "unix" and rest:
            return cls("unix", path=rest)
        if scheme == "tcp":
            host, _, port = rest.rpartition(":")
            if host and port.isdigit():
                return cls("tcp", host=host.strip("[]"), port=int(port))
        raise ValidationError(
            f"listen address {text!r}: use unix:/path/to.sock or tcp:HOST:PORT", field="listen"
        )

    def __str__(self) -> str:
        return f"unix:{self.path}" if self.kind == "unix" else f"tcp:{self.host}:{self.port}"


class _Connection(asyncio.Protocol):
    def __init__(self, server: WorkerServer) -> None:
        self._server = server
        self._reader = FrameReader()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self.transport: asyncio.Transport | None = None
        #: Replies finished in one loop iteration leave in one write (Note [coalesced writes]
        #: in trims.runtime.worker.client).
        self._writer = FrameWriter()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self._writer.attach(self.transport)
        self._server._connected(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._writer.detach()
        self._server._disconnected(self)
        for task in self._tasks.values():
            task.cancel()

    def send(self, request_id: int, kind: Kind, meta: dict[str, Any] | None, body: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self._writer.send(encode_frame(request_id, kind, meta, body))

    def close(self) -> None:
        """Write what is queued, then close the stream."""
        if self.transport is not None:
            self._writer.flush()
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._reader.feed(data)
        except (ProtocolError, ValueError) as e:
            log.warning("closing worker connection after a malformed frame: %s", e)
            assert self.transport is not None
            self.transport.close()
            return
        for frame in frames:
            if frame.kind is Kind.INVOKE or frame.kind is Kind.INFER:
                task = asyncio.get_running_loop().create_task(self._run(frame))
                self._tasks[frame.request_id] = task
            elif frame.kind is Kind.CANCEL:
                running = self._tasks.pop(frame.request_id, None)
                if running is not None:
                    running.cancel()
            elif frame.kind is Kind.ACTIVATE:
                self._server.activate(frame.meta.get(META_TRACE) or {})

    async def _run(self, frame: Frame) -> None:
        rid = frame.request_id
        try:
            meta, body = await self._server.run_request(frame)
        except asyncio.CancelledError:
            self._tasks.pop(rid, None)
            raise
        except TrimsError as e:
            self.send(rid, Kind.ERROR, {"code": e.code, "message": e.message}, b"")
        else:
            self.send(rid, Kind.REPLY, meta, body)
        self._tasks.pop(rid, None)


class WorkerServer:
    def __init__(self, address: ListenAddress, runner: RequestRunner, hello: dict[str, Any]):
        self.address = address
        self._runner = runner
        self._hello = hello
        self._state: dict[str, Any] | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        #: Set once a client has received a "failed" HELLO (the worker may then exit).
        self.failure_delivered = asyncio.Event()
        #: Set by a client's ACTIVATE while this worker is a standby (see :meth:`set_standby`).
        self.activated = asyncio.Event()
        #: The W3C trace context that ACTIVATE carried (its init joins that trace).
        self.activate_trace: dict[str, str] = {}

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.address.kind == "unix":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address.path)
            self._server = await loop.create_unix_server(
                lambda: _Connection(self), path=self.address.path
            )
        else:
            self._server = await loop.create_server(
                lambda: _Connection(self), host=self.address.host, port=self.address.port
            )
        log.debug("worker listening on %s", self.address)

    def set_ready(self, **info: Any) -> None:
        """Tell every client the instance is ready; ``info`` (e.g. model_acquire_s) rides along.

        What init made lives as long as the instance: it is frozen out of the garbage
        collector's full passes first (Note [gc tail] in trims.runtime.gateway.server).
        """
        gc.freeze()
        self._say({**self._hello, **info, "state": "ready"})

    def set_standby(self) -> None:
        """Tell every client this standby is prepared; it runs init on the first ACTIVATE."""
        self._say({**self._hello, "state": "standby"})

    def activate(self, trace: dict[str, str]) -> None:
        """A client's ACTIVATE: honoured once, and only while a standby (else ignored)."""
        if self._state is not None and self._state["state"] == "standby":
            if not self.activated.is_set():
                self.activate_trace = {str(k): str(v) for k, v in dict(trace).items()}
            self.activated.set()

    def set_failed(self, reason: str, code: str | None = None) -> None:
        """Tell every client init failed for ``reason``; ``code`` (a trims error's) lets the
        gateway tell a start refused for capacity (``resource_exhausted``: the store could not
        fit a model) from a broken function."""
        failed: dict[str, Any] = {**self._hello, "state": "failed", "reason": reason}
        if code is not None:
            failed["code"] = code
        self._say(failed)
        if self._connections:
            self.failure_delivered.set()

    def _say(self, state: dict[str, Any]) -> None:
        """Make ``state`` this worker's HELLO, to every connection now and every later one."""
        self._state = state
        for conn in list(self._connections):
            conn.send(0, Kind.HELLO, state, b"")

    def _connected(self, conn: _Connection) -> None:
        self._connections.add(conn)
        if self._state is not None:
            conn.send(0, Kind.HELLO, self._state, b"")
            if self._state["state"] == "failed":
                self.failure_delivered.set()

    def _disconnected(self, conn: _Connection) -> None:
        self._connections.discard(conn)

    async def run_request(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        if self._draining:
            raise Unavailable("instance is draining for shutdown; send the request elsewhere")
        if self._state is None or self._state["state"] != "ready":
            raise Unavailable("instance is not ready; wait for its HELLO")
        self._inflight += 1
        self._idle.clear()
        try:
            return await self._runner(frame)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    async def drain(self) -> None:
        """Refuse new requests and wait until the in-flight ones have answered."""
        self._draining = True
        if self._server is not None:
            self._server.close()
        if self._inflight:
            log.info("worker draining %d in-flight request(s) before exit", self._inflight)
        await self._idle.wait()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.close()
        await asyncio.sleep(0)
        if self.address.kind == "unix":
            with contextlib.suppress(FileNotFoundError):
                Path(self.address.path).unlink()
