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

All integers are big-endian. ``length`` is bounded by ``MAX_FRAME`` for replies and by the much
smaller ``MAX_REQUEST_FRAME`` for requests (the daemon reads requests with that limit), and
``nfds`` by ``MAX_FDS`` (requests carry none); a frame that breaks either is a
:class:`ProtocolError` and the connection is closed after an error reply. When ``nfds > 0`` the
descriptors travel as SCM_RIGHTS ancillary data attached to the first byte of the header, so a
reader that reads the header with ``recvmsg`` gets them.

The payload is strict JSON: UTF-8, an object at the top, nested at most ``MAX_DEPTH`` deep,
integers of at most ``MAX_INT_DIGITS`` digits, no ``NaN``/``Infinity`` and no float that
overflows to infinity. Every way a frame can break these rules is a :class:`ProtocolError`
(with ``details["reason"]``, one of :data:`DECODE_REASONS`), never another exception.

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
           device? (GPU UUID or index), strict? (bool)         (+ 1 fd: memfd or CUDA VMM fd)
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
on write), ``{"kind": "file", "size": int, "populate"?: bool}`` (a read-only fd of the verified
disk-tier file, for ``tier: "disk"`` and for the CPU tier's file backing; mapped like a memfd;
``populate: false`` says the file maps in few faults, so a background populate is not worth it),
``{"kind": "cuda_vmm", "device_uuid", "size", "alloc_size"}`` (import with
``cuMemImportFromShareableHandle``), or ``{"kind": "cuda_ipc", "device_uuid", "ipc_handle"}``
(hex; no fd; the legacy fallback).

An ``acquire`` of the ``"cpu"`` tier that the tier cannot hold (its budget held by leased or
pinned copies, or memory pressure) is answered from the disk tier: ``tier: "disk"``, a ``file``
handle, and ``degraded_from: "cpu"``; with ``strict: true`` it fails with
``resource_exhausted`` instead (Note [degraded acquires] in ``trims.daemon.store``).

Admin operations are answered only on the admin socket (mode 0600); the store socket that
function instances get (mode 0660) answers the first six. Function code therefore can acquire
and release models but never administer the store.
"""

from __future__ import annotations

import array
import itertools
import json
import math
import os
import re
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
#: Largest payload accepted, in bytes (a manifest of ~100k tensors fits). Replies use it.
MAX_FRAME = 16 << 20
#: Largest request payload the daemon reads, in bytes. The largest legitimate request is an
#: ``add`` with a 4096-character source and an access list; 64 KiB leaves room for that and keeps
#: what one connection can make the daemon buffer small.
MAX_REQUEST_FRAME = 64 << 10
#: Most descriptors one frame may carry.
MAX_FDS = 16
#: Deepest nesting of arrays/objects in a payload. Messages nest 4-5 levels; 32 leaves room
#: and keeps the parser (and anything walking the result) far from Python's recursion limit.
MAX_DEPTH = 32
#: Most digits of one JSON integer. 64-bit values have at most 20; a 5,000-digit number costs
#: quadratic time to convert and is refused instead.
MAX_INT_DIGITS = 32
#: The ``details["reason"]`` of every ProtocolError raised while decoding (metric labels).
DECODE_REASONS = (
    "header",
    "magic",
    "version",
    "length",
    "fds",
    "encoding",
    "json",
    "depth",
    "number",
    "type",
)


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
    VERIFY = "verify"


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


def _bad(reason: str, message: str) -> ProtocolError:
    return ProtocolError(message, reason=reason)


def decode_header(data: bytes, max_length: int = MAX_FRAME, max_fds: int = MAX_FDS) -> FrameHeader:
    """Parse and bound-check a 12-byte header (``max_*`` lower the limits, e.g. for requests)."""
    if len(data) != HEADER_SIZE:
        raise _bad("header", f"frame header must be {HEADER_SIZE} bytes, got {len(data)}")
    magic, version, flags, nfds, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise _bad("magic", f"bad frame magic {magic!r}: this socket speaks the trims protocol")
    if version != PROTOCOL_VERSION:
        raise _bad(
            "version",
            f"protocol version {version} is not supported (this side speaks "
            f"{PROTOCOL_VERSION}); use matching trims versions for daemon and client",
        )
    if length > max_length:
        raise _bad("length", f"frame length {length} exceeds the limit of {max_length} bytes")
    if nfds > max_fds:
        raise _bad("fds", f"frame announces {nfds} descriptors; the limit is {max_fds}")
    return FrameHeader(version, flags, nfds, length)


#: A JSON string (valid JSON only: elsewhere the parser fails anyway), for the depth scan.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
#: Opening brackets step +1, closing ones -1 (as signed bytes).
_BRACKET_STEPS = str.maketrans("[{]}", "\x01\x01\xff\xff")


def json_depth(text: str) -> int:
    """How deep arrays/objects nest in ``text`` (a JSON document), without parsing it.

    Strings are skipped, so brackets inside them do not count. Linear time, no recursion.
    """
    opening = text.count("[") + text.count("{")
    if opening <= 1:
        return opening
    brackets = _NOT_BRACKETS.sub("", _JSON_STRING.sub("", text))
    steps = array.array("b", brackets.translate(_BRACKET_STEPS).encode("latin-1"))
    return max(itertools.accumulate(steps), default=0)


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _bad("number", f"an integer of {digits} digits exceeds {MAX_INT_DIGITS} digits")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _bad("number", f"number {text[:40]!r} does not fit a finite float")
    return value


def _parse_constant(name: str) -> float:
    raise _bad("number", f"{name} is not JSON; send finite numbers only")


def decode_payload(data: bytes, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """The message of one payload; every way it can be malformed is a ProtocolError."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad("encoding", f"frame payload is not valid UTF-8: {e}") from e
    depth = json_depth(text)
    if depth > max_depth:
        raise _bad("depth", f"frame payload nests {depth} levels deep; the limit is {max_depth}")
    try:
        message = json.loads(
            text,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except ProtocolError:
        raise
    except RecursionError as e:
        raise _bad("depth", "frame payload nests too deep to parse") from e
    except ValueError as e:
        raise _bad("json", f"frame payload is not valid JSON: {e}") from e
    if not isinstance(message, dict):
        raise _bad("type", f"frame payload must be a JSON object, got {type(message).__name__}")
    return message


class FrameDecoder:
    """Incremental decoder for a byte stream (used by the asyncio server, which gets no fds).

    Memory stays bounded: the header is checked as soon as its 12 bytes are in, so a frame
    longer than ``max_length`` is refused before any of its payload is buffered, and the buffer
    never holds more than one partial frame plus the bytes of the last ``feed``.
    """

    def __init__(
        self, max_length: int = MAX_FRAME, max_fds: int = MAX_FDS, max_depth: int = MAX_DEPTH
    ) -> None:
        self._buf = bytearray()
        self._max_length = max_length
        self._max_fds = max_fds
        self._max_depth = max_depth

    @property
    def buffered(self) -> int:
        """Bytes of a frame that has started arriving but is not complete (0 between frames)."""
        return len(self._buf)

    def feed(self, data: bytes) -> Iterator[dict[str, Any]]:
        """Add bytes; yield every complete message. Raises ProtocolError on a bad frame."""
        self._buf += data
        while len(self._buf) >= HEADER_SIZE:
            header = decode_header(bytes(self._buf[:HEADER_SIZE]), self._max_length, self._max_fds)
            end = HEADER_SIZE + header.length
            if len(self._buf) < end:
                return
            payload = bytes(self._buf[HEADER_SIZE:end])
            del self._buf[:end]
            yield decode_payload(payload, self._max_depth)


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
    """Who is on the other end of a Unix socket, taken at connect time: pid, uid and primary
    gid (SO_PEERCRED) and the supplementary groups (SO_PEERGROUPS)."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()


#: SO_PEERGROUPS (Linux >= 4.13; not in the socket module): the peer's supplementary groups
#: as they were at connect(), an array of gid_t.
SO_PEERGROUPS = 59
#: NGROUPS_MAX on Linux: the most supplementary groups a process can have.
_NGROUPS_MAX = 65536


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("i2I"))
    pid, uid, gid = struct.unpack("i2I", raw)
    return PeerCredentials(pid, uid, gid, _peer_groups(sock, pid))


def _peer_groups(sock: socket.socket, pid: int) -> tuple[int, ...]:
    """The peer's supplementary groups; () (primary gid only) when they cannot be known."""
    for count in (64, _NGROUPS_MAX):
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * count)
        except OSError as e:
            if e.errno == 34:  # ERANGE: more groups than the buffer holds
                continue
            break  # ENOPROTOOPT: a kernel before 4.13
        return tuple(array.array("I", raw[: len(raw) - len(raw) % 4]))
    # Fallback for old kernels: /proc/<pid>/status as it is now, not as it was at connect().
    # The peer may have changed its groups since, or exited and its pid been reused by another
    # process: a race SO_PEERGROUPS does not have. It can only widen access to a group the
    # process at that pid holds now; a daemon that cannot accept that should run on >= 4.13.
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return tuple(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()
