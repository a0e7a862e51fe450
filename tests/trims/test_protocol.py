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


def _payload_frame(payload: bytes, nfds: int = 0) -> bytes:
    return struct.pack("!4sBBHI", b"TRIM", 1, 0, nfds, len(payload)) + payload


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xff\xfe", "encoding"),
        (b"{not json", "json"),
        (b"[1,2]", "type"),
        (b'{"a":' + b"[" * 33 + b"]" * 33 + b"}", "depth"),
        (b'{"a":' + b"[" * 100_000 + b"}", "depth"),
        (b'{"a":' + b"9" * 5000 + b"}", "number"),
        (b'{"a":-' + b"9" * 33 + b"}", "number"),
        (b'{"a":NaN}', "number"),
        (b'{"a":-Infinity}', "number"),
        (b'{"a":1e999}', "number"),
    ],
)
def test_every_decode_failure_is_a_protocol_error_with_a_reason(
    payload: bytes, reason: str
) -> None:
    with pytest.raises(ProtocolError) as info:
        list(protocol.FrameDecoder().feed(_payload_frame(payload)))
    assert info.value.details["reason"] == reason
    assert reason in protocol.DECODE_REASONS


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    text = '{"a": "[[[[{{{{\\"[[[[", "b": [[1]]}'
    assert protocol.json_depth(text) == 3
    deep = {"s": "[" * 1000}
    frame = protocol.encode_frame(deep)
    assert list(protocol.FrameDecoder().feed(frame)) == [deep]


def test_the_deepest_and_largest_accepted_values_decode() -> None:
    nested: object = 1
    for _ in range(protocol.MAX_DEPTH - 1):
        nested = [nested]
    message = {"a": nested, "n": -(10 ** (protocol.MAX_INT_DIGITS - 1)), "f": 1.5e300}
    assert list(protocol.FrameDecoder().feed(protocol.encode_frame(message))) == [message]


def test_request_limits_refuse_long_frames_before_buffering_and_any_descriptors() -> None:
    dec = protocol.FrameDecoder(protocol.MAX_REQUEST_FRAME, max_fds=0)
    header = struct.pack("!4sBBHI", b"TRIM", 1, 0, 0, protocol.MAX_REQUEST_FRAME + 1)
    with pytest.raises(ProtocolError, match="exceeds the limit of 65536") as info:
        list(dec.feed(header))
    assert info.value.details["reason"] == "length"
    with pytest.raises(ProtocolError, match="descriptors") as info:
        list(protocol.FrameDecoder(max_fds=0).feed(_payload_frame(b"{}", nfds=1)))
    assert info.value.details["reason"] == "fds"


def test_the_decoder_reports_what_it_buffers_of_a_partial_frame() -> None:
    dec = protocol.FrameDecoder()
    frame = protocol.encode_frame({"id": 1})
    assert list(dec.feed(frame + frame[:5])) == [{"id": 1}]
    assert dec.buffered == 5
    assert list(dec.feed(frame[5:])) == [{"id": 1}]
    assert dec.buffered == 0


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
