"""One client connection of the daemon: reading frames within the limits, dispatching requests,
sending replies with their descriptors.

Asyncio streams cannot pass descriptors, so a connection is a raw non-blocking socket: it waits
for readability with ``loop.add_reader`` and reads with ``recv``, and writes with
``socket.sendmsg`` (waiting for writability on EAGAIN). The limits it enforces are listed in
:mod:`trims.daemon.server`.

Note [idle connections]
~~~~~~~~~~~~~~~~~~~~~~~
Leases belong to the connection (Note [lease keeps memory alive] in :mod:`trims.daemon.leases`):
closing a connection ends its leases. A function instance that maps a model may not send a
byte for hours and must keep its model, so the idle timeout never applies to a connection that
holds a lease or has a request in flight (an ``acquire`` waiting for a load, an ``add``
downloading). It applies only to connections that hold nothing: they cost a slot and a
descriptor, and closing them loses nothing but the socket. The idle clock starts at accept and
restarts with every byte received and every request that completes. The close is announced
with an ``unavailable`` error frame (id null; retryable): reconnect when the store is needed.
"""

from __future__ import annotations

import array
import asyncio
import dataclasses
import logging
import os
import socket
import struct
import time
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from trims.daemon.dispatch import dispatch
from trims.daemon.store import Caller, StoreReply
from trims.errors import (
    ProtocolError,
    Timeout,
    TrimsError,
    Unavailable,
    ValidationError,
)
from trims.protocol import FrameDecoder, PeerCredentials, Progress, encode_frame

if TYPE_CHECKING:
    from trims.daemon.server import Server

log = logging.getLogger(__name__)

#: Bytes read from a socket at once (and reserved from the read budget before each read).
READ_CHUNK = 64 << 10
#: Most requests of one connection in flight; the connection is not read until one finishes.
MAX_IN_FLIGHT = 64
#: A peer that does not read its replies for this long is disconnected (seconds).
SEND_TIMEOUT = 30.0
#: Progress frames of one request are sent at most this often (seconds).
PROGRESS_INTERVAL = 0.2

# Note [request sender]
# ~~~~~~~~~~~~~~~~~~~~~
# ``SO_PEERCRED`` names the process that *connected*. A connection can be passed on: the
# zygote connects a pooled worker to the store and hands it the socket (Note [warm pool] in
# trims.runtime.executors.zygote), so every lease of that worker would be listed under the
# zygote's pid. The listening sockets set ``SO_PASSCRED``, so the kernel attaches the sending
# process's credentials to every write and a read never returns bytes of two senders; the
# lease records the pid that sent its acquire (``pid`` in the lease table, beside
# ``connected_pid``). Authorization still uses the connect-time credentials (``Caller.peer``).
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_CREDENTIALS_SPACE = socket.CMSG_SPACE(_CREDENTIALS.size)


def _sender(ancillary: list[tuple[int, int, bytes]], default: int) -> int:
    """The pid in a read's ``SCM_CREDENTIALS``, or ``default`` when it carries none."""
    for level, kind, data in ancillary:
        ours = (level, kind) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS)
        if ours and len(data) >= _CREDENTIALS.size:
            return int(_CREDENTIALS.unpack_from(data)[0])
    return default


def spawn(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    """A named task whose failure is logged, never left as an unretrieved exception."""
    task = asyncio.create_task(coro, name=name)
    task.add_done_callback(_reap)
    return task


def _reap(task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    error = task.exception()
    if error is not None:
        log.error("%s failed (%r); the daemon goes on", task.get_name(), error, exc_info=error)


class _Close(Exception):
    """Ends a connection: ``error`` is sent to the peer, ``reason`` labels the metric."""

    def __init__(self, reason: str, error: TrimsError, what: str) -> None:
        super().__init__(what)
        self.reason = reason
        self.error = error
        self.what = what


class Connection:
    """One client connection: its socket, credentials, request tasks and send lock."""

    def __init__(
        self, server: Server, sock: socket.socket, ident: int, admin: bool, peer: PeerCredentials
    ) -> None:
        self.server = server
        self.sock = sock
        self.ident = ident
        self.peer = peer
        # The admin socket is 0600 already; a peer that is neither the owner nor root (e.g.
        # after someone loosened the mode) still gets only the client operations.
        admin = admin and peer.uid in (os.getuid(), 0)
        self.caller = Caller(ident, peer, admin, peer.pid)
        self._send_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._loop = asyncio.get_running_loop()
        #: Requests started and not yet answered (see Note [idle connections]).
        self._in_flight = 0
        self._last_active = self._loop.time()
        #: Bytes this connection holds of the server's read budget (Note [read budget]).
        self._held = 0
        self._waiter: asyncio.Future[bool] | None = None

    async def serve(self) -> None:
        try:
            await self._read_loop()
        except _Close as close:
            await self._close_with(close)
        except (ConnectionError, OSError) as e:
            log.debug("connection of pid %d ended: %s", self.peer.pid, e)
        finally:
            self.server.read_budget.release(self._held)
            self._held = 0
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _read_loop(self) -> None:
        limits = self.server.settings.limits
        budget = self.server.read_budget
        decoder = FrameDecoder(limits.max_request_frame, max_fds=0)
        frame_started = self._loop.time()
        while True:
            mid_frame = decoder.buffered > 0
            await self._wait_readable(mid_frame, frame_started)
            if mid_frame:
                try:
                    async with asyncio.timeout_at(frame_started + limits.read_timeout):
                        reserved = await budget.reserve(READ_CHUNK)
                except TimeoutError:
                    raise self._timeout("read_timeout") from None
            else:
                reserved = await budget.reserve(READ_CHUNK)
            self._held += reserved
            sender = self.peer.pid
            try:
                data, ancillary, _, _ = self.sock.recvmsg(reserved, _CREDENTIALS_SPACE)
                sender = _sender(ancillary, sender)
            except BlockingIOError:
                data = None
            if data == b"":
                return
            if data:
                now = self._loop.time()
                self._last_active = now
                completed = False
                try:
                    for message in decoder.feed(data):
                        await self._slots.acquire()
                        self._start(message, sender)
                        completed = True
                except ProtocolError as e:
                    raise _Close("protocol", e, f"sent a bad frame ({e.message})") from e
                if not mid_frame or completed:
                    # Note: set after any wait for request slots, so a client whose pipelined
                    # requests the daemon is slow to take is not blamed for the delay.
                    frame_started = self._loop.time()
            budget.release(self._held - decoder.buffered)
            self._held = decoder.buffered

    async def _wait_readable(self, mid_frame: bool, frame_started: float) -> None:
        """Return once the socket is readable; raise _Close when a timeout ends the connection."""
        limits = self.server.settings.limits
        while True:
            deadline: float | None = None
            reason = ""
            if mid_frame:
                deadline, reason = frame_started + limits.read_timeout, "read_timeout"
            elif limits.idle_timeout and self._idle():
                deadline, reason = self._last_active + limits.idle_timeout, "idle"
            now = self._loop.time()
            if deadline is not None and now >= deadline:
                raise self._timeout(reason)
            if await self._readable(None if deadline is None else deadline - now):
                return

    def _idle(self) -> bool:
        """Whether the idle timeout applies now (Note [idle connections])."""
        return self._in_flight == 0 and not self.server.store.leases.held_by(self.ident)

    async def _readable(self, timeout: float | None) -> bool:
        """True when the socket is readable; False after ``timeout`` or a request finishing."""
        waiter: asyncio.Future[bool] = self._loop.create_future()

        def ready() -> None:
            if not waiter.done():
                waiter.set_result(True)

        fd = self.sock.fileno()
        self._waiter = waiter
        self._loop.add_reader(fd, ready)
        try:
            async with asyncio.timeout(timeout):
                return await waiter
        except TimeoutError:
            return False
        finally:
            self._loop.remove_reader(fd)
            self._waiter = None

    def _wake(self) -> None:
        """A request finished: the reader re-checks whether the idle timeout applies."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(False)

    def _timeout(self, reason: str) -> _Close:
        limits = self.server.settings.limits
        if reason == "idle":
            t = limits.idle_timeout
            return _Close(
                reason,
                Unavailable(
                    f"connection closed after {t:g} s without requests or leases "
                    "(--idle-timeout); reconnect when you need the store"
                ),
                f"was idle for {t:g} s without leases or requests",
            )
        t = limits.read_timeout
        return _Close(
            reason,
            Timeout(
                f"a request frame started arriving but was not complete within {t:g} s "
                "(--read-timeout); send each frame whole"
            ),
            f"left a frame incomplete for {t:g} s",
        )

    async def _close_with(self, close: _Close) -> None:
        """Count, log (rate-limited per uid) and announce why the daemon closes the connection."""
        metrics = self.server.metrics
        metrics.connections_closed.labels(close.reason).inc()
        metrics.errors.labels(close.error.code).inc()
        if close.reason == "protocol":
            metrics.protocol_errors.labels(str(close.error.details.get("reason", "other"))).inc()
        self.server.peer_log.log(
            logging.INFO if close.reason == "idle" else logging.WARNING,
            self.peer.uid,
            "client pid %d (uid %d) %s; connection closed",
            self.peer.pid,
            self.peer.uid,
            close.what,
        )
        await self._send_quietly({"id": None, "ok": False, "error": close.error.to_dict()})

    def _start(self, message: dict[str, Any], sender: int) -> None:
        self._in_flight += 1
        caller = self.caller
        if sender != caller.pid:
            caller = dataclasses.replace(caller, pid=sender)
        task = spawn(
            self._handle(message, caller), f"request {message.get('op')!r} of {self.ident}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, message: dict[str, Any], caller: Caller) -> None:
        rid = message.get("id")
        valid_id = isinstance(rid, int) and not isinstance(rid, bool)
        reply: StoreReply | None = None
        try:
            try:
                reply = await self._answer(message, rid, caller)
                frame: dict[str, Any] = {"id": rid, "ok": True, "result": reply.result}
                fds: Sequence[int] = reply.fds
            except TrimsError as e:
                self.server.metrics.errors.labels(e.code).inc()
                frame, fds = (
                    {"id": rid if valid_id else None, "ok": False, "error": e.to_dict()},
                    (),
                )
            await self._reply(frame, fds)
        finally:
            if reply is not None and reply.close_fds:
                for fd in reply.fds:
                    os.close(fd)
            self._in_flight -= 1
            self._last_active = self._loop.time()
            self._slots.release()
            self._wake()

    async def _reply(self, frame: dict[str, Any], fds: Sequence[int]) -> None:
        try:
            try:
                await self.send(frame, fds)
            except ProtocolError as e:
                # The reply itself breaks the frame limits (e.g. a gigantic manifest).
                log.error("reply to pid %d cannot be framed (%s); sent an error", self.peer.pid, e)
                error = TrimsError(f"the reply cannot be sent ({e.message}); see the daemon log")
                await self.send({"id": frame.get("id"), "ok": False, "error": error.to_dict()})
        except (ConnectionError, OSError) as e:
            self.server.peer_log.log(
                logging.INFO,
                self.peer.uid,
                "reply to pid %d (uid %d) not delivered (%s); its connection is closing",
                self.peer.pid,
                self.peer.uid,
                e,
            )

    async def _answer(self, message: dict[str, Any], rid: object, caller: Caller) -> StoreReply:
        """Dispatch one request; any failure comes out as a TrimsError."""
        pending: list[asyncio.Task[None]] = []
        try:
            if not isinstance(rid, int) or isinstance(rid, bool):
                raise ValidationError("request 'id' must be an integer")
            op = message.get("op")
            progress = self._progress(rid, pending) if op in ("add", "load", "verify") else None
            try:
                return await dispatch(
                    self.server.store,
                    caller,
                    op,
                    message.get("args", {}),
                    progress,
                    self.server.settings.admin_socket_path.name,
                )
            finally:
                # progress frames go out before the final reply
                await asyncio.gather(*pending)
        except TrimsError:
            raise
        except asyncio.CancelledError as e:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise
            # Nobody cancelled this request: code on a worker thread raised
            # concurrent.futures.CancelledError, which asyncio re-raises as its own. Passed
            # on, it would end the request without a reply, and the client would wait for
            # its timeout.
            log.error("request %r of pid %d failed: %r from a worker thread",
                      message.get("op"), caller.pid, e, exc_info=True)  # fmt: skip
            raise TrimsError(f"internal error in {message.get('op')!r}; see the daemon log") from e
        except Exception as e:
            log.exception("request %r of pid %d failed", message.get("op"), caller.pid)
            # Only the store's owner sees the cause: it may name host paths.
            cause = f": {e}" if self.caller.admin else ""
            raise TrimsError(
                f"internal error in {message.get('op')!r}{cause}; see the daemon log"
            ) from e

    def _progress(self, rid: int, pending: list[asyncio.Task[None]]) -> Progress:
        """A thread-safe progress callback that sends throttled progress frames."""
        loop = self._loop
        last_stage, last_at = [""], [0.0]

        def schedule(frame: dict[str, Any]) -> None:
            pending.append(spawn(self._send_quietly(frame), f"progress of request {rid}"))

        def report(stage: str, done: int, total: int | None) -> None:
            now = time.monotonic()
            final = total is not None and done >= total
            if stage == last_stage[0] and not final and now - last_at[0] < PROGRESS_INTERVAL:
                return
            last_stage[0], last_at[0] = stage, now
            frame = {"id": rid, "progress": {"stage": stage, "done": done, "total": total}}
            loop.call_soon_threadsafe(schedule, frame)

        return report

    async def _send_quietly(self, frame: dict[str, Any]) -> None:
        try:
            await self.send(frame)
        except (ConnectionError, OSError):
            pass

    async def send(self, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
        """Send one frame, its descriptors attached to the first byte."""
        data = memoryview(encode_frame(message, len(fds)))
        anc = (
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
        )
        async with self._send_lock:
            while data:
                try:
                    sent = self.sock.sendmsg([data], anc)
                except BlockingIOError:
                    await self._writable()
                    continue
                anc = []
                data = data[sent:]

    async def _writable(self) -> None:
        ready: asyncio.Future[None] = self._loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        self._loop.add_writer(self.sock.fileno(), wake)
        try:
            await asyncio.wait_for(ready, SEND_TIMEOUT)
        except TimeoutError as e:
            raise ConnectionError(f"peer did not read for {SEND_TIMEOUT:.0f} s") from e
        finally:
            self._loop.remove_writer(self.sock.fileno())
