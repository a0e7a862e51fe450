"""FrameWriter: frames queued in one loop iteration leave in one write, in order."""

from __future__ import annotations

import asyncio
import socket

import pytest

from trims.runtime.wire import FrameReader, FrameWriter, Kind, encode_frame


async def _pair() -> tuple[asyncio.Transport, socket.socket]:
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    transport, _ = await asyncio.get_running_loop().connect_accepted_socket(asyncio.Protocol, ours)
    return transport, theirs


async def test_frames_of_one_iteration_leave_together_after_it() -> None:
    transport, peer = await _pair()
    writer = FrameWriter()
    writer.attach(transport)
    try:
        writer.send(encode_frame(1, Kind.INVOKE, {"h": {"a": "b"}}, b"first"))
        writer.send(encode_frame(2, Kind.INVOKE, None, b"second"))
        with pytest.raises(BlockingIOError):
            peer.recv(65536)  # nothing written while the iteration runs
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        frames = FrameReader().feed(peer.recv(65536))  # both in what one write delivered
        assert [(f.request_id, f.meta, f.body) for f in frames] == [
            (1, {"h": {"a": "b"}}, b"first"),
            (2, {}, b"second"),
        ]
    finally:
        transport.close()
        peer.close()


async def test_flush_writes_at_once_and_detach_drops_the_queue() -> None:
    transport, peer = await _pair()
    writer = FrameWriter()
    writer.attach(transport)
    try:
        writer.send(encode_frame(7, Kind.REPLY, {"s": 200}, b"now"))
        writer.flush()
        assert [f.body for f in FrameReader().feed(peer.recv(65536))] == [b"now"]
        writer.send(encode_frame(8, Kind.REPLY, None, b"never"))
        writer.detach()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        with pytest.raises(BlockingIOError):
            peer.recv(65536)
    finally:
        transport.close()
        peer.close()
