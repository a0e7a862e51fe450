"""The store protocol: length-prefixed JSON frames over a Unix socket, fds passed with SCM_RIGHTS.

This module is where the daemon (``trims.daemon``) and the function side (``trims.runtime``)
meet; neither imports the other.

Frame
-----
::

    0      4        5        6          8                12
    ┌──────┬────────┬────────┬──────────┬────────────────┬──────────────────────┐
    │"TRIM"│version │ flags  │ nfds u16 │ length u32     │ JSON payload (UTF-8) │
    └──────┴────────┴────────┴──────────┴────────────────┴──────────────────────┘

All integers are big-endian. ``length`` is bounded by ``MAX_FRAME`` and ``nfds`` by ``MAX_FDS``;
a frame that breaks either is a :class:`ProtocolError` and the connection is closed after an
error reply. When ``nfds > 0`` the descriptors travel as SCM_RIGHTS ancillary data attached to
the first byte of the header, so a reader that reads the header with ``recvmsg`` gets them.

Messages
--------
Request ``{"id": int, "op": str, "args": {...}}``. Replies carry the same ``id``:

* ``{"id", "ok": true, "result": {...}}`` - final, with ``nfds`` descriptors attached;
* ``{"id", "ok": false, "error": {"code", "message", "retryable", "details"?}}`` - final,
  ``code`` from :data:`trims.errors.ERROR_CODES`;
* ``{"id", "progress": {"stage": str, "done": int, "total": int | null}}`` - not final; sent
  during long operations (``add``, ``load``; stages "download", "convert", "verify", "load")
  so clients can draw a progress bar.

Operations (``Op``) and their arguments / results:

=========  ==================================================  ==============================
op         args                                                result (+ fds)
=========  ==================================================  ==============================
hello      client: str                                         daemon_version, protocol, pid
acquire    name, version?, digest?, tier? ("cpu"|"gpu"|"disk"),lease, tier, manifest, handle
           device? (GPU UUID or index)                         (+ 1 fd: memfd or CUDA VMM fd)
release    lease                                               {}
info       name, version?                                      model
list       -                                                   models
stats      -                                                   tiers, leases, clients
load       name, version?, tier                                model          (admin)
evict      name, version?, tier?                               evicted        (admin)
pin        name, version?, tier?                               model          (admin)
unpin      name, version?, tier?                               model          (admin)
add        name, source, version?, format?, sha256?, access?   model          (admin)
remove     name, version?, force?                              removed        (admin)
=========  ==================================================  ==============================

``handle`` describes how to map the descriptor:
``{"kind": "memfd", "size": int}`` (map ``MAP_PRIVATE``, read-only shared pages, copy-on-write
on write), ``{"kind": "file", "size": int}`` (a read-only fd of the verified disk-tier file,
for ``tier: "disk"``; mapped like a memfd),
``{"kind": "cuda_vmm", "device_uuid", "size", "alloc_size"}`` (import with
``cuMemImportFromShareableHandle``), or ``{"kind": "cuda_ipc", "device_uuid", "ipc_handle"}``
(hex; no fd; the legacy fallback).

Admin operations are answered only on the admin socket (mode 0600); the store socket that
function instances get (mode 0660) answers the first six. Function code therefore can acquire
and release models but never administer the store.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from trims.errors import ProtocolError

MAGIC = b"TRIM"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("!4sBBHI")
HEADER_SIZE = HEADER.size
#: Largest payload accepted, in bytes (a manifest of ~100k tensors fits).
MAX_FRAME = 16 << 20
#: Most descriptors one frame may carry.
MAX_FDS = 16


#: Progress callback of long operations: (stage, done_bytes, total_bytes or None). The daemon
#: reports through it and sends progress frames; the client passes those frames to one.
Progress = Callable[[str, int, int | None], None]


class Op(StrEnum):
    HELLO = "hello"
    ACQUIRE = "acquire"
    RELEASE = "release"
    INFO = "info"
    LIST = "list"
    STATS = "stats"
    LOAD = "load"
    EVICT = "evict"
    PIN = "pin"
    UNPIN = "unpin"
    ADD = "add"
    REMOVE = "remove"


#: Operations a function instance may call (the store socket).
CLIENT_OPS = frozenset({Op.HELLO, Op.ACQUIRE, Op.RELEASE, Op.INFO, Op.LIST, Op.STATS})
#: Operations that administer the store (the admin socket only).
ADMIN_OPS = frozenset(Op) - CLIENT_OPS


def encode_frame(message: dict[str, Any], nfds: int = 0) -> bytes:
    """Header + JSON payload. Raises ProtocolError if the message is too large."""
    if not 0 <= nfds <= MAX_FDS:
        raise ProtocolError(f"a frame carries at most {MAX_FDS} descriptors, not {nfds}")
    payload = json.dumps(message, separators=(",", ":")).encode()
    if len(payload) > MAX_FRAME:
        raise ProtocolError(f"frame payload of {len(payload)} bytes exceeds {MAX_FRAME}")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, nfds, len(payload)) + payload


@dataclass(frozen=True)
class FrameHeader:
    version: int
    flags: int
    nfds: int
    length: int


def decode_header(data: bytes) -> FrameHeader:
    """Parse and bound-check a 12-byte header."""
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"frame header must be {HEADER_SIZE} bytes, got {len(data)}")
    magic, version, flags, nfds, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {magic!r}: this socket speaks the trims protocol")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version} is not supported (this side speaks "
            f"{PROTOCOL_VERSION}); use matching trims versions for daemon and client"
        )
    if length > MAX_FRAME:
        raise ProtocolError(f"frame length {length} exceeds the limit of {MAX_FRAME} bytes")
    if nfds > MAX_FDS:
        raise ProtocolError(f"frame announces {nfds} descriptors; the limit is {MAX_FDS}")
    return FrameHeader(version, flags, nfds, length)


def decode_payload(data: bytes) -> dict[str, Any]:
    try:
        message = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"frame payload is not valid UTF-8 JSON: {e}") from e
    if not isinstance(message, dict):
        raise ProtocolError(f"frame payload must be a JSON object, got {type(message).__name__}")
    return message


class FrameDecoder:
    """Incremental decoder for a byte stream (used by the asyncio server, which gets no fds)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> Iterator[dict[str, Any]]:
        """Add bytes; yield every complete message. Raises ProtocolError on a bad frame."""
        self._buf += data
        while len(self._buf) >= HEADER_SIZE:
            header = decode_header(bytes(self._buf[:HEADER_SIZE]))
            end = HEADER_SIZE + header.length
            if len(self._buf) < end:
                return
            payload = bytes(self._buf[HEADER_SIZE:end])
            del self._buf[:end]
            yield decode_payload(payload)


def send_frame(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send one frame on a blocking socket, the descriptors attached to its first byte."""
    data = memoryview(encode_frame(message, len(fds)))
    if fds:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        sent = sock.sendmsg([data], anc)
        data = data[sent:]
    if data:
        sock.sendall(data)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _fds_from_ancillary(ancdata: list[tuple[int, int, bytes]], into: list[int]) -> None:
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
            into.extend(fds)


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Receive one frame on a blocking socket: the message and the descriptors it carried.

    Descriptors are received close-on-exec. The caller owns them; on any error they are closed.
    Raises ConnectionError when the peer closed the connection.
    """
    fds: list[int] = []
    try:
        header = bytearray()
        anc_size = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
        while len(header) < HEADER_SIZE:
            chunk, ancdata, flags, _ = sock.recvmsg(
                HEADER_SIZE - len(header), anc_size, socket.MSG_CMSG_CLOEXEC
            )
            _fds_from_ancillary(ancdata, fds)
            if flags & socket.MSG_CTRUNC:
                raise ProtocolError("descriptors were truncated in transit")
            if not chunk:
                raise ConnectionError("the trims daemon closed the connection")
            header += chunk
        h = decode_header(bytes(header))
        payload = bytearray(h.length)
        view = memoryview(payload)
        got = 0
        while got < h.length:
            n = sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("the trims daemon closed the connection mid-frame")
            got += n
        if len(fds) != h.nfds:
            raise ProtocolError(f"frame announced {h.nfds} descriptors but carried {len(fds)}")
        return decode_payload(bytes(payload)), fds
    except BaseException:
        _close_all(fds)
        raise


@dataclass(frozen=True)
class PeerCredentials:
    """Who is on the other end of a Unix socket (SO_PEERCRED), taken at connect time."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCredentials(pid, uid, gid)
