"""The daemon's socket server: two Unix sockets, one task per connection, fds over SCM_RIGHTS.

asyncio streams cannot pass descriptors, so connections are raw non-blocking sockets read with
``loop.sock_recv`` and written with ``socket.sendmsg`` (waiting for writability on EAGAIN).

Lifecycle: ``start()`` binds both sockets and starts accepting; ``close()`` stops accepting,
removes the socket files, closes every connection (ending its leases). A bad frame closes only
the connection that sent it; an error in one request answers only that request.
"""

from __future__ import annotations

import array
import asyncio
import grp
import itertools
import logging
import os
import socket
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trims.config import DaemonSettings
from trims.daemon.metrics import DaemonMetrics
from trims.daemon.ops import dispatch
from trims.daemon.store import Caller, Progress, Reply, Store
from trims.errors import ProtocolError, QueueFull, TrimsError, Unavailable, ValidationError
from trims.protocol import FrameDecoder, encode_frame, peer_credentials

log = logging.getLogger(__name__)

#: Most client connections served at once; further ones get Unavailable and are closed.
MAX_CONNECTIONS = 1024
#: Most requests of one connection in flight; the connection is not read until one finishes.
MAX_IN_FLIGHT = 64
#: A peer that does not read its replies for this long is disconnected (seconds).
SEND_TIMEOUT = 30.0
#: Pause after a failed accept (e.g. out of descriptors) before trying again (seconds).
ACCEPT_RETRY = 0.5
#: Progress frames of one request are sent at most this often (seconds).
PROGRESS_INTERVAL = 0.2


def _bind(path: Path, mode: int, group: str | None) -> socket.socket:
    """A listening Unix socket at ``path`` with ``mode`` (and ``group``) set before listen."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ValidationError(f"{path} exists and is not a socket; choose another --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()
        else:
            raise Unavailable(
                f"another daemon is serving {path}; stop it or choose another --socket"
            )
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    try:
        if group is not None:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
            os.chown(path, -1, gid)
        os.chmod(path, mode)
    except (KeyError, OSError) as e:
        sock.close()
        path.unlink()
        raise ValidationError(
            f"cannot give socket {path} group {group!r} / mode {mode:o}: {e}; check --socket-group"
        ) from e
    sock.listen(128)
    sock.setblocking(False)
    return sock


class Connection:
    """One client connection: its socket, credentials, request tasks and send lock."""

    def __init__(self, server: Server, sock: socket.socket, ident: int, admin: bool) -> None:
        self.server = server
        self.sock = sock
        peer = peer_credentials(sock)
        # The admin socket is 0600 already; a peer that is neither the owner nor root (e.g.
        # after someone loosened the mode) still gets only the client operations.
        admin = admin and peer.uid in (os.getuid(), 0)
        self.caller = Caller(ident, peer, admin)
        self._send_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        decoder = FrameDecoder()
        try:
            while True:
                data = await loop.sock_recv(self.sock, 1 << 16)
                if not data:
                    return
                try:
                    for message in decoder.feed(data):
                        await self._slots.acquire()
                        task = asyncio.create_task(self._handle(message))
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
                except ProtocolError as e:
                    log.warning(
                        "client pid %d sent a bad frame (%s); connection closed",
                        self.caller.peer.pid,
                        e.message,
                    )
                    self.server.metrics.errors.labels(e.code).inc()
                    await self.send({"id": None, "ok": False, "error": e.to_dict()})
                    return
        except (ConnectionError, OSError) as e:
            log.debug("connection of pid %d ended: %s", self.caller.peer.pid, e)
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self.sock.close()

    async def _handle(self, message: dict[str, Any]) -> None:
        rid = message.get("id")
        reply: Reply | None = None
        try:
            reply = await self._answer(message, rid)
            frame: dict[str, Any] = {"id": rid, "ok": True, "result": reply.result}
            fds: Sequence[int] = reply.fds
        except TrimsError as e:
            self.server.metrics.errors.labels(e.code).inc()
            valid_id = isinstance(rid, int) and not isinstance(rid, bool)
            frame, fds = {"id": rid if valid_id else None, "ok": False, "error": e.to_dict()}, ()
        try:
            await self.send(frame, fds)
        except (ConnectionError, OSError) as e:
            log.info(
                "reply to pid %d not delivered (%s); its connection is closing",
                self.caller.peer.pid,
                e,
            )
        finally:
            if reply is not None and reply.close_fds:
                for fd in reply.fds:
                    os.close(fd)
            self._slots.release()

    async def _answer(self, message: dict[str, Any], rid: object) -> Reply:
        """Dispatch one request; any failure comes out as a TrimsError."""
        pending: list[asyncio.Task[None]] = []
        try:
            if not isinstance(rid, int) or isinstance(rid, bool):
                raise ValidationError("request 'id' must be an integer")
            op = message.get("op")
            progress = self._progress(rid, pending) if op in ("add", "load") else None
            try:
                return await dispatch(
                    self.server.store,
                    self.caller,
                    op,
                    message.get("args", {}),
                    progress,
                    self.server.settings.admin_socket_path.name,
                )
            finally:
                # progress frames go out before the final reply
                await asyncio.gather(*pending)
        except (asyncio.CancelledError, TrimsError):
            raise
        except Exception as e:
            log.exception("request %r of pid %d failed", message.get("op"), self.caller.peer.pid)
            # Only the store's owner sees the cause: it may name host paths.
            cause = f": {e}" if self.caller.admin else ""
            raise TrimsError(
                f"internal error in {message.get('op')!r}{cause}; see the daemon log"
            ) from e

    def _progress(self, rid: int, pending: list[asyncio.Task[None]]) -> Progress:
        """A thread-safe progress callback that sends throttled progress frames."""
        loop = asyncio.get_running_loop()
        last_stage, last_at = [""], [0.0]

        def schedule(frame: dict[str, Any]) -> None:
            pending.append(asyncio.create_task(self._send_quietly(frame)))

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
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_writer(self.sock.fileno(), wake)
        try:
            await asyncio.wait_for(ready, SEND_TIMEOUT)
        except TimeoutError as e:
            raise ConnectionError(f"peer did not read for {SEND_TIMEOUT:.0f} s") from e
        finally:
            loop.remove_writer(self.sock.fileno())


class Server:
    """Both sockets of one daemon, and every connection they accepted."""

    def __init__(self, settings: DaemonSettings, store: Store, metrics: DaemonMetrics) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self._listeners: list[tuple[socket.socket, Path]] = []
        self._accepting: list[asyncio.Task[None]] = []
        self._connections: dict[int, asyncio.Task[None]] = {}
        self._ids = itertools.count(1)

    async def start(self) -> None:
        if self._listeners:
            raise RuntimeError("Server.start() called twice")
        s = self.settings
        for path, mode, group, admin in (
            (s.socket_path, s.socket_mode, s.socket_group, False),
            (s.admin_socket_path, 0o600, None, True),
        ):
            sock = _bind(path, mode, group)
            self._listeners.append((sock, path))
            self._accepting.append(
                asyncio.create_task(self._accept(sock, admin), name=f"accept {path.name}")
            )

    async def _accept(self, listener: socket.socket, admin: bool) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as e:
                log.error(
                    "cannot accept a connection (%s); still serving the open ones, retrying "
                    "in %.1f s",
                    e,
                    ACCEPT_RETRY,
                )
                await asyncio.sleep(ACCEPT_RETRY)
                continue
            sock.setblocking(False)
            if len(self._connections) >= MAX_CONNECTIONS:
                await self._refuse(sock)
                continue
            ident = next(self._ids)
            conn = Connection(self, sock, ident, admin)
            task = asyncio.create_task(self._run(conn, ident), name=f"connection {ident}")
            self._connections[ident] = task

    async def _refuse(self, sock: socket.socket) -> None:
        error = QueueFull(
            f"the daemon serves at most {MAX_CONNECTIONS} connections; retry later or close "
            "idle clients"
        )
        try:
            sock.send(encode_frame({"id": None, "ok": False, "error": error.to_dict()}))
        except OSError:
            pass
        sock.close()

    async def _run(self, conn: Connection, ident: int) -> None:
        self.store.connections += 1
        try:
            await conn.serve()
        finally:
            self.store.connections -= 1
            ended = self.store.end_connection(ident)
            if ended:
                log.info(
                    "client pid %d disconnected; its %d lease(s) ended", conn.caller.peer.pid, ended
                )
            del self._connections[ident]

    async def close(self) -> None:
        for task in self._accepting:
            task.cancel()
        await asyncio.gather(*self._accepting, return_exceptions=True)
        for sock, path in self._listeners:
            sock.close()
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        tasks = list(self._connections.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
