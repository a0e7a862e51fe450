"""Moving bytes between two processes: sealed memfd mapping vs pipe vs Unix socket vs file.

A consumer process (``python -m trims.kernels.transfer_ipc FD``) serves requests on a Unix
socket. For each transfer the producer reads ``CLOCK_MONOTONIC`` (shared by all processes),
hands the bytes over, and the consumer answers with the clock reading at which it holds them
and has read every byte once (an xor over 64-bit words), so all modalities end in the same
state: the data is in the consumer's memory and has been used.

- ``memfd-map``: the producer passes a sealed memfd (SCM_RIGHTS); the consumer maps it
  MAP_PRIVATE and reads it: what a trims function does when it acquires a model;
- ``memfd-map-populate``: the same with MAP_POPULATE, so the kernel maps every page in the
  mmap call instead of one page fault per page on first touch;
- ``memfd-create-write-seal``: the producer-side cost of building that memfd from a buffer (the
  store's promotion of a model into its CPU tier), timed in the producer alone;
- ``pipe`` / ``unix-socket``: the bytes are written into a pipe / a stream socket and received
  into a preallocated buffer;
- ``file-read``: the consumer reads a file the producer wrote earlier (page cache warm).
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np

from trims.errors import TrimsError, Unavailable

log = logging.getLogger(__name__)

_REQ = struct.Struct("<B Q")  # op, size
_REP = struct.Struct("<q Q")  # monotonic ns at completion, checksum
OP_QUIT, OP_MEMFD, OP_PIPE, OP_SOCKET, OP_FILE, OP_MEMFD_POPULATE = range(6)
SEALS = (
    getattr(os, "F_SEAL_SEAL", 1)
    | getattr(os, "F_SEAL_SHRINK", 2)
    | getattr(os, "F_SEAL_GROW", 4)
    | getattr(os, "F_SEAL_WRITE", 8)
)


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def checksum(buf: memoryview | bytes | bytearray | mmap.mmap) -> int:
    """xor of the buffer's 64-bit words (the tail bytes padded): reads every byte once."""
    n = len(buf)
    words = np.frombuffer(buf, dtype=np.uint64, count=n // 8)
    acc = int(np.bitwise_xor.reduce(words)) if words.size else 0
    tail = bytes(memoryview(buf)[n - n % 8 :]) if n % 8 else b""
    return acc ^ int.from_bytes(tail.ljust(8, b"\0"), "little") if tail else acc


def build_memfd(payload: memoryview) -> int:
    """A sealed memfd holding ``payload`` (the caller closes it)."""
    fd = os.memfd_create("trims-transfer", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(payload)
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
        import fcntl

        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass
class Consumer:
    """The producer's handle on a running consumer process and its channels."""

    proc: subprocess.Popen[bytes]
    ctrl: socket.socket
    data: socket.socket
    pipe_w: int
    workdir: tempfile.TemporaryDirectory[str]

    @classmethod
    def start(cls) -> Consumer:
        ctrl, ctrl_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        data, data_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pipe_r, pipe_w = os.pipe()
        fds = (ctrl_child.fileno(), data_child.fileno(), pipe_r)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "trims.kernels.transfer_ipc", *map(str, fds)],
                pass_fds=fds,
            )
        finally:
            ctrl_child.close()
            data_child.close()
            os.close(pipe_r)
        consumer = cls(proc, ctrl, data, pipe_w, tempfile.TemporaryDirectory(prefix="trims-xfer-"))
        try:
            consumer._reply()
        except BaseException:
            consumer.close()
            raise
        return consumer

    def __enter__(self) -> Consumer:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.ctrl.sendall(_REQ.pack(OP_QUIT, 0))
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("transfer consumer %d did not quit; killing it", self.proc.pid)
            self.proc.kill()
            self.proc.wait()
        self.ctrl.close()
        self.data.close()
        os.close(self.pipe_w)
        self.workdir.cleanup()

    def _reply(self) -> tuple[int, int]:
        """The consumer's answer (the first one, sent at start-up, says it is ready)."""
        buf = bytearray()
        while len(buf) < _REP.size:
            chunk = self.ctrl.recv(_REP.size - len(buf))
            if not chunk:
                raise Unavailable("the transfer consumer process exited unexpectedly")
            buf += chunk
        done, check = _REP.unpack(bytes(buf))
        return done, check

    def transfer(self, op: int, payload: memoryview, expected: int) -> float:
        """Seconds from the start of the hand-off until the consumer has read every byte."""
        size = len(payload)
        if op in (OP_MEMFD, OP_MEMFD_POPULATE):
            fd = build_memfd(payload)
            try:
                t0 = now_ns()
                socket.send_fds(self.ctrl, [_REQ.pack(op, size)], [fd])
            finally:
                os.close(fd)
        elif op == OP_FILE:
            path = Path(self.workdir.name) / "payload"
            path.write_bytes(payload)
            t0 = now_ns()
            self.ctrl.sendall(_REQ.pack(op, size) + os.fsencode(str(path)).ljust(256, b"\0"))
        else:
            t0 = now_ns()
            self.ctrl.sendall(_REQ.pack(op, size))
            if op == OP_PIPE:
                view, done = memoryview(payload), 0
                while done < size:
                    done += os.write(self.pipe_w, view[done:])
            else:
                self.data.sendall(payload)
        t1, check = self._reply()
        if check != expected:
            raise TrimsError(f"transfer op {op} of {size} bytes arrived corrupted")
        return (t1 - t0) / 1e9


def _serve(ctrl: socket.socket, data: socket.socket, pipe_r: int) -> None:
    buffers: dict[int, bytearray] = {}
    ctrl.sendall(_REP.pack(now_ns(), 0))
    while True:
        msg, fds, _flags, _addr = socket.recv_fds(ctrl, _REQ.size, 1)
        if not msg:
            return
        msg += _recv_exact(ctrl, _REQ.size - len(msg))
        op, size = _REQ.unpack(msg)
        if op == OP_QUIT:
            return
        if op in (OP_MEMFD, OP_MEMFD_POPULATE):
            fd = fds[0]
            flags = mmap.MAP_PRIVATE | (mmap.MAP_POPULATE if op == OP_MEMFD_POPULATE else 0)
            try:
                with mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ) as m:
                    check = checksum(m)
            finally:
                os.close(fd)
        else:
            buf = buffers.setdefault(size, bytearray(size))
            view = memoryview(buf)
            if op == OP_FILE:
                path = _recv_exact(ctrl, 256).rstrip(b"\0")
                with open(path, "rb", buffering=0) as f:
                    got = 0
                    while got < size:
                        got += f.readinto(view[got:]) or 0
            else:
                got = 0
                while got < size:
                    n = (
                        os.readv(pipe_r, [view[got:]])
                        if op == OP_PIPE
                        else data.recv_into(view[got:])
                    )
                    if n == 0:
                        return
                    got += n
            check = checksum(buf)
        ctrl.sendall(_REP.pack(now_ns(), check))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("control socket closed mid-request")
        buf += chunk
    return bytes(buf)


def main(argv: list[str]) -> int:
    ctrl = socket.socket(fileno=int(argv[0]))
    data = socket.socket(fileno=int(argv[1]))
    try:
        _serve(ctrl, data, int(argv[2]))
    finally:
        ctrl.close()
        data.close()
        os.close(int(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
