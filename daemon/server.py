"""The daemon's socket server: two Unix sockets, one task per connection, fds over SCM_RIGHTS.

Lifecycle: ``start()`` binds both sockets and starts accepting; ``close()`` stops accepting,
removes the socket files, closes every connection (ending its leases). A bad frame closes only
the connection that sent it; an error in one request answers only that request.

Limits (``DaemonSettings.limits``, :class:`trims.daemon.settings.ServerLimits`)
---------------------------------------------------------------------
Every limit is per peer first, so one client cannot deny service to the others:

* **Connections.** The store socket serves at most ``max_connections`` connections, and at most
  ``max_connections_per_uid`` of one uid (root and the daemon's owner included). The admin
  socket has its own ``max_admin_connections`` slots, so a flood of the store socket never
  blocks administration. A refused connection gets a ``queue_full`` error frame naming the
  limit and the flag that raises it, then is closed (metric ``trims_connections_refused``).
* **Requests are small.** Requests are read with ``max_request_frame`` (64 KiB) as the frame
  limit, not the protocol's 16 MiB ``MAX_FRAME`` (replies carry manifests). A header announcing
  more is refused before any payload is buffered. All connections together buffer at most
  ``read_buffer_total`` bytes of partial frames (see Note [read budget] in
  :mod:`trims.daemon.limits`): at the limit the daemon stops reading instead of growing.
* **Read timeout.** A frame that has started arriving must be complete within
  ``read_timeout`` seconds, else the connection gets a ``timeout`` error frame and is closed.
* **Idle timeout.** See Note [idle connections] in :mod:`trims.daemon.connection`: only
  connections without leases and without requests in flight are closed after
  ``idle_timeout`` seconds of silence.
* **Malformed frames.** Every decode failure is a ProtocolError (``trims.protocol``); it is
  answered with a ``protocol`` error frame, counted by reason (``trims_protocol_errors``), and
  closes that connection only.
* **Logs.** Every line about one peer (its bad frames, refused, timed-out and ended
  connections, undelivered replies) goes through one per-uid token bucket (``peer_log_burst``
  per ``peer_log_interval``); the rest are counted (``trims_log_suppressed``) and summarized as
  "suppressed N", so a uid looping acquire and disconnect cannot flood the log.

Each accepted socket becomes a :class:`trims.daemon.connection.Connection`, which reads,
dispatches and answers; this module binds, accepts within the slots and closes.
"""

from __future__ import annotations

import asyncio
import grp
import itertools
import logging
import os
import socket
import stat
from pathlib import Path

from trims.daemon.connection import Connection, spawn
from trims.daemon.limits import ConnectionSlots, PeerLog, ReadBudget
from trims.daemon.metrics import DaemonMetrics
from trims.daemon.private import socket_folder
from trims.daemon.settings import DaemonSettings
from trims.daemon.store import Store
from trims.errors import (
    QueueFull,
    Unavailable,
    ValidationError,
)
from trims.protocol import PeerCredentials, encode_frame, peer_credentials

log = logging.getLogger(__name__)

#: Pause after a failed accept (e.g. out of descriptors) before trying again (seconds).
ACCEPT_RETRY = 0.5


def _bind(path: Path, mode: int, group: str | None) -> socket.socket:
    """A listening Unix socket at ``path`` with ``mode`` (and ``group``) set before listen."""
    socket_folder(path.parent)
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
    # Note [request sender]: accepted sockets inherit it, so each read says who sent it.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.listen(128)
    sock.setblocking(False)
    return sock


class Server:
    """Both sockets of one daemon, and every connection they accepted."""

    def __init__(self, settings: DaemonSettings, store: Store, metrics: DaemonMetrics) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        limits = settings.limits
        #: Slots per socket: the store socket's (False) and the admin socket's own (True).
        self._slots = {
            False: ConnectionSlots(limits.max_connections, limits.max_connections_per_uid),
            True: ConnectionSlots(limits.max_admin_connections, None),
        }
        self.read_budget = ReadBudget(limits.read_buffer_total)
        self.peer_log = PeerLog(
            log, limits.peer_log_burst, limits.peer_log_interval, metrics.log_suppressed.inc
        )
        metrics.read_buffer_bytes.set_function(lambda: self.read_budget.used)
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
            self._accepting.append(spawn(self._accept(sock, admin), f"accept {path.name}"))

    async def _accept(self, listener: socket.socket, admin: bool) -> None:
        loop = asyncio.get_running_loop()
        slots = self._slots[admin]
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
            try:
                sock.setblocking(False)
                peer = peer_credentials(sock)
            except OSError as e:
                log.info("a connection ended before it could be served (%s)", e)
                sock.close()
                continue
            refusal = slots.refusal(peer.uid)
            if refusal is not None:
                self._refuse(sock, peer, admin, refusal)
                continue
            slots.take(peer.uid)
            ident = next(self._ids)
            conn = Connection(self, sock, ident, admin, peer)
            self._connections[ident] = spawn(self._run(conn, slots), f"connection {ident}")

    def _refuse(self, sock: socket.socket, peer: PeerCredentials, admin: bool, limit: str) -> None:
        """Answer a connection over a limit with an error naming it, then close it."""
        limits = self.settings.limits
        if admin:
            limit = "admin"
            text = (
                f"the admin socket serves at most {limits.max_admin_connections} connections at "
                "once (--max-admin-connections); close other admin clients and retry"
            )
        elif limit == "per_uid":
            text = (
                f"uid {peer.uid} already holds {limits.max_connections_per_uid} connections to "
                "the store socket, the most one uid may hold (--max-connections-per-uid); "
                "close idle connections of this uid or raise the limit"
            )
        else:
            text = (
                f"the store socket serves at most {limits.max_connections} connections at once "
                "(--max-connections); retry later, close idle clients or raise the limit"
            )
        error = QueueFull(text, limit=limit)
        self.metrics.connections_refused.labels(limit).inc()
        self.metrics.errors.labels(error.code).inc()
        self.peer_log.warning(
            peer.uid,
            "refused a connection of pid %d (uid %d): %s limit reached",
            peer.pid,
            peer.uid,
            limit,
        )
        try:
            sock.send(encode_frame({"id": None, "ok": False, "error": error.to_dict()}))
        except OSError:
            pass
        sock.close()

    async def _run(self, conn: Connection, slots: ConnectionSlots) -> None:
        self.store.connections += 1
        try:
            await conn.serve()
        finally:
            # Note: no await from here on, so the slot is free before a waiting accept runs.
            slots.give(conn.peer.uid)
            conn.sock.close()
            self.store.connections -= 1
            ended = self.store.end_connection(conn.ident)
            if ended:
                self.peer_log.log(
                    logging.INFO,
                    conn.peer.uid,
                    "client pid %d (uid %d) disconnected; its %d lease(s) ended",
                    conn.peer.pid,
                    conn.peer.uid,
                    ended,
                )
            del self._connections[conn.ident]

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
        self.peer_log.close()
