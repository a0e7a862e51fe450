"""Frames, bounds and descriptor passing of the store protocol, over real socket pairs."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator

import pytest

from trims import protocol
from trims.errors import ProtocolError


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def test_round_trip_without_fds(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    msg = {"id": 7, "op": "list", "args": {}}
    protocol.send_frame(a, msg)
    got, fds = protocol.recv_frame(b)
    assert got == msg
    assert fds == []


def test_descriptors_travel_with_the_frame(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    fd = os.memfd_create("proto-test", os.MFD_CLOEXEC)
    try:
        os.write(fd, b"weights")
        protocol.send_frame(a, {"id": 1, "ok": True, "result": {}}, [fd])
        got, fds = protocol.recv_frame(b)
        assert got["ok"] is True
        assert len(fds) == 1
        try:
            assert os.pread(fds[0], 7, 0) == b"weights"
            assert os.get_inheritable(fds[0]) is False  # received close-on-exec
        finally:
            os.close(fds[0])
    finally:
        os.close(fd)


def test_two_frames_back_to_back_keep_their_fds_apart(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    r, w = os.pipe()
    try:
        protocol.send_frame(a, {"id": 1}, [r])
        protocol.send_frame(a, {"id": 2})
        m1, f1 = protocol.recv_frame(b)
        m2, f2 = protocol.recv_frame(b)
        assert (m1["id"], len(f1)) == (1, 1)
        assert (m2["id"], f2) == (2, [])
        os.close(f1[0])
    finally:
        os.close(r)
        os.close(w)


def test_frame_decoder_handles_split_and_joined_frames() -> None:
    frames = protocol.encode_frame({"id": 1}) + protocol.encode_frame({"id": 2})
    dec = protocol.FrameDecoder()
    got = []
    for i in range(len(frames)):
        got.extend(dec.feed(frames[i : i + 1]))
    assert got == [{"id": 1}, {"id": 2}]


@pytest.mark.parametrize(
    ("header", "needle"),
    [
        (struct.pack("!4sBBHI", b"HTTP", 1, 0, 0, 2), "magic"),
        (struct.pack("!4sBBHI", b"TRIM", 9, 0, 0, 2), "protocol version 9"),
        (struct.pack("!4sBBHI", b"TRIM", 1, 0, 0, protocol.MAX_FRAME + 1), "exceeds"),
        (struct.pack("!4sBBHI", b"TRIM", 1, 0, 99, 2), "descriptors"),
    ],
)
def test_bad_headers_are_rejected_with_a_reason(header: bytes, needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle):
        list(protocol.FrameDecoder().feed(header + b"{}"))


@pytest.mark.parametrize("payload", [b"\xff\xfe", b"[1,2]", b"{not json"])
def test_bad_payloads_are_protocol_errors(payload: bytes) -> None:
    frame = struct.pack("!4sBBHI", b"TRIM", 1, 0, 0, len(payload)) + payload
    with pytest.raises(ProtocolError):
        list(protocol.FrameDecoder().feed(frame))


def test_oversized_message_is_refused_before_sending() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.encode_frame({"blob": "x" * (protocol.MAX_FRAME + 1)})


def test_announced_fds_must_arrive(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    payload = b"{}"
    a.sendall(struct.pack("!4sBBHI", b"TRIM", 1, 0, 1, len(payload)) + payload)
    with pytest.raises(ProtocolError, match="announced 1"):
        protocol.recv_frame(b)


def test_peer_closing_is_a_connection_error(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.close()
    with pytest.raises(ConnectionError):
        protocol.recv_frame(b)


def test_peer_credentials_name_this_process(pair: tuple[socket.socket, socket.socket]) -> None:
    cred = protocol.peer_credentials(pair[0])
    assert (cred.pid, cred.uid, cred.gid) == (os.getpid(), os.getuid(), os.getgid())


def test_admin_and_client_ops_partition_the_op_table() -> None:
    assert frozenset(protocol.Op) == protocol.ADMIN_OPS | protocol.CLIENT_OPS
    assert not protocol.ADMIN_OPS & protocol.CLIENT_OPS
    assert protocol.Op.ADD in protocol.ADMIN_OPS
    assert protocol.Op.ACQUIRE in protocol.CLIENT_OPS
