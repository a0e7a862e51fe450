"""WorkerInstance.wait_ready keeps its deadline when the worker's address swallows connects."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from trims.errors import Timeout
from trims.runtime.executors.base import WorkerInstance


class _At(WorkerInstance):
    """An instance whose worker is at ``address`` and never ends."""

    def __init__(self, address: str) -> None:
        super().__init__("i-1", "fn", "test")
        self._address = address

    def address(self) -> str:
        return self._address

    async def terminate(self, grace_s: float) -> None:
        self._end("terminated")


@pytest.fixture
def blackhole() -> Iterator[int]:
    """A TCP port whose accept queue is full: the kernel drops further SYNs, so a connect
    hangs for its SYN retries (minutes), like a pod IP gone from the network."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = int(server.getsockname()[1])
    fillers = []
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        try:
            filler.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(filler)
    yield port
    for s in (*fillers, server):
        s.close()


async def test_a_connect_that_hangs_does_not_outlast_the_deadline(blackhole: int) -> None:
    instance = _At(f"tcp:127.0.0.1:{blackhole}")
    # 20 s: far beyond the 0.5 s asked for, far below a connect's SYN retries.
    with pytest.raises(Timeout, match=r"did not open tcp:127\.0\.0\.1"):
        await asyncio.wait_for(instance.wait_ready(0.5), 20)


async def test_nothing_listening_is_retried_until_the_deadline() -> None:
    instance = _At("unix:/nonexistent/trims-test.sock")
    with pytest.raises(Timeout, match=r"within 0\.3 s"):
        await asyncio.wait_for(instance.wait_ready(0.3), 20)
