"""A minimal store client for the daemon tests, built on the protocol module only."""

from __future__ import annotations

import mmap
import os
import socket
from pathlib import Path
from typing import Any

from trims.errors import error_from_dict
from trims.protocol import recv_frame, send_frame


class RawClient:
    """One connection; ``call`` sends a request and returns (result, fds) or raises."""

    def __init__(self, path: Path | str, timeout: float = 60.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self._next = 0
        self.progress: list[dict[str, Any]] = []

    def call(self, op: str, **args: Any) -> tuple[dict[str, Any], list[int]]:
        self._next += 1
        send_frame(self.sock, {"id": self._next, "op": op, "args": args})
        while True:
            message, fds = recv_frame(self.sock)
            if "progress" in message:
                self.progress.append(message["progress"])
                continue
            assert message["id"] == self._next
            if not message["ok"]:
                raise error_from_dict(message["error"])
            return message["result"], fds

    def result(self, op: str, **args: Any) -> dict[str, Any]:
        """``call`` for operations that carry no descriptors."""
        result, fds = self.call(op, **args)
        assert fds == []
        return result

    def acquire_map(self, name: str, **args: Any) -> tuple[dict[str, Any], mmap.mmap]:
        """Acquire and map MAP_PRIVATE (the fd is closed after mapping, as clients do)."""
        result, fds = self.call("acquire", name=name, **args)
        assert len(fds) == 1
        try:
            size = result["handle"]["size"]
            mapping = mmap.mmap(fds[0], size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fds[0])
        return result, mapping

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def frames_until_closed(sock: socket.socket) -> list[dict[str, Any]]:
    """Every frame the daemon sends on ``sock`` until it closes it (descriptors closed)."""
    frames = []
    while True:
        try:
            message, fds = recv_frame(sock)
        except ConnectionError:
            return frames
        for fd in fds:
            os.close(fd)
        frames.append(message)
