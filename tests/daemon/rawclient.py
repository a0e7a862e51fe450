"""A minimal store client for the daemon tests, built on the protocol module only, and
:func:`as_nobody`, the same requests sent from a child running as another uid (built on
:func:`tests.fixtures.users.run_as`)."""

from __future__ import annotations

import mmap
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.fixtures.users import NOBODY, run_as
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
    frames: list[dict[str, Any]] = []
    while True:
        try:
            message, fds = recv_frame(sock)
        except ConnectionError:
            return frames
        for fd in fds:
            os.close(fd)
        frames.append(message)


def as_nobody(
    sock: Path, requests: Sequence[tuple[str, dict[str, Any]]], groups: Sequence[int] = ()
) -> list[dict[str, Any]]:
    """Send ``requests`` on one store connection from a child running as uid/gid nobody with
    supplementary ``groups``; the replies (descriptors closed in the child)."""

    def send() -> list[dict[str, Any]]:
        replies = []
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(60)
            s.connect(str(sock))
            for i, (op, args) in enumerate(requests):
                send_frame(s, {"id": i, "op": op, "args": args})
                reply, fds = recv_frame(s)
                for fd in fds:
                    os.close(fd)
                reply["nfds"] = len(fds)
                replies.append(reply)
        return replies

    return run_as(NOBODY, send, groups)
