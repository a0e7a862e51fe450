from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trims.errors import ProtocolError
from trims.runtime.wire import (
    COMPACT_META,
    HEADER,
    FrameReader,
    Kind,
    decode_arrays,
    encode_arrays,
    encode_frame,
)
from trims.runtime.worker.client import ConnectionLost, WorkerConnection


def _bytes(buffers: list[bytes]) -> bytes:
    return b"".join(buffers)


def test_frames_round_trip_when_fed_byte_by_byte() -> None:
    data = _bytes(encode_frame(7, Kind.INVOKE, {"h": {"a": "b"}}, b"\x00body\xff"))
    data += _bytes(encode_frame(8, Kind.REPLY, None, b""))
    reader = FrameReader()
    frames = [f for i in range(len(data)) for f in reader.feed(data[i : i + 1])]
    assert [(f.request_id, f.kind, f.meta, f.body) for f in frames] == [
        (7, Kind.INVOKE, {"h": {"a": "b"}}, b"\x00body\xff"),
        (8, Kind.REPLY, {}, b""),
    ]


def test_many_frames_in_one_chunk_and_large_bodies() -> None:
    big = bytes(range(256)) * 40_000
    data = b"".join(_bytes(encode_frame(i, Kind.INVOKE, None, big)) for i in range(1, 4))
    frames = FrameReader().feed(data)
    assert [f.request_id for f in frames] == [1, 2, 3]
    assert all(f.body == big for f in frames)


def test_malformed_frames_raise_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        FrameReader().feed(HEADER.pack(4, 1, Kind.INVOKE, 0, 100))
    with pytest.raises(ProtocolError, match="kind"):
        FrameReader().feed(HEADER.pack(12, 1, 99, 0, 0))
    with pytest.raises(ProtocolError, match="flags"):
        FrameReader().feed(HEADER.pack(12, 1, Kind.INVOKE, 0x80, 0))


@pytest.mark.parametrize(
    "meta",
    [
        {"h": {"content-type": "text/plain", "x-a": ""}},
        {"s": 200, "h": {"content-type": "application/json"}},
        {"s": 404},
        {"h": {"x-unicode": "caf\u00e9 \u2603"}},
    ],
)
def test_headers_and_status_travel_compact_and_come_back_the_same(meta: dict[str, Any]) -> None:
    data = _bytes(encode_frame(5, Kind.REPLY, meta, b"body"))
    assert data[9] & COMPACT_META
    (frame,) = FrameReader().feed(data)
    assert frame.meta == meta and frame.body == b"body"


@pytest.mark.parametrize(
    "meta",
    [
        {"h": {"x-nul": "a\x00b"}},  # a NUL would split the field
        {"s": 200, "h": {}},  # compact has no empty map
        {"s": True},
        {"s": 10**9},  # more digits than a compact status has
        {"s": 200, "t": {"traceparent": "00-x"}},
        {"h": {"a": ["b"]}},
    ],
)
def test_any_other_meta_stays_json_and_comes_back_the_same(meta: dict[str, Any]) -> None:
    data = _bytes(encode_frame(5, Kind.REPLY, meta))
    assert not data[9] & COMPACT_META
    (frame,) = FrameReader().feed(data)
    assert frame.meta == meta


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"200\x00content-type", "without its value"),
        (b"20x", "status"),
        (b"\xff\xfe", "UTF-8"),
        ("\u00b2".encode(), "status"),  # a digit to str.isdigit, not to int()
    ],
)
def test_a_broken_compact_meta_is_a_protocol_error(raw: bytes, match: str) -> None:
    head = HEADER.pack(HEADER.size - 4 + len(raw), 1, Kind.REPLY, COMPACT_META, len(raw))
    with pytest.raises(ProtocolError, match=match):
        FrameReader().feed(head + raw)


def test_trace_headers_travel_in_the_meta() -> None:
    trace = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    (frame,) = FrameReader().feed(_bytes(encode_frame(1, Kind.INFER, {"t": trace}, b"x")))
    assert frame.meta["t"] == trace


def test_arrays_round_trip_without_copying() -> None:
    arrays = {
        "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
        "i64": np.array([-1, 2**40], dtype=np.int64),
        "f16": np.ones((2, 0, 3), dtype=np.float16),
        "bool": np.array([True, False]),
        "strided": np.arange(20, dtype=np.int32)[::2],
        "text": np.array([b"hello", b"", b"\x00\xff"], dtype=object),
    }
    body = encode_arrays(arrays)
    out = decode_arrays(body)
    assert list(out) == list(arrays)
    for name, value in arrays.items():
        assert out[name].shape == value.shape
        if name != "text":
            assert out[name].dtype == value.dtype
        np.testing.assert_array_equal(out[name], value)
    assert not out["f32"].flags.writeable
    base = out["f32"]
    while isinstance(base, np.ndarray):
        base = base.base
    assert base is body


def test_truncated_array_body_is_a_protocol_error() -> None:
    body = encode_arrays({"x": np.zeros(100, dtype=np.float64)})
    with pytest.raises(ProtocolError, match="past the end"):
        decode_arrays(body[:-8])
    with pytest.raises(ProtocolError):
        decode_arrays(b"\x00\x00\x00\x05{oops")


def _raw_frame(meta: bytes, kind: Kind = Kind.HELLO) -> bytes:
    """A frame whose meta bytes are exactly ``meta`` (a broken or hostile peer's)."""
    return HEADER.pack(HEADER.size - 4 + len(meta), 0, kind, 0, len(meta)) + meta


@pytest.mark.parametrize("meta", [b"{not json", b"\xff\xfe", b"[1, 2]", b'"text"', b"[" * 100_000])
def test_meta_that_is_not_a_json_object_is_a_protocol_error(meta: bytes) -> None:
    with pytest.raises(ProtocolError, match="bad frame meta"):
        FrameReader().feed(_raw_frame(meta))


async def test_a_worker_sending_malformed_meta_ends_the_connection_cleanly(
    tmp_path: Path,
) -> None:
    """The client ends the connection with a clear reason; nothing reaches asyncio's
    exception handler (the bug: JSONDecodeError escaped ``data_received``)."""
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))

    async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_raw_frame(b"{not json"))
        await writer.drain()
        await reader.read()  # until the client hangs up
        writer.close()

    path = tmp_path / "w.sock"
    server = await asyncio.start_unix_server(worker, path=str(path))
    try:
        conn = await WorkerConnection.open(f"unix:{path}")
        with pytest.raises(ConnectionLost, match="malformed frame: bad frame meta"):
            await asyncio.wait_for(conn.hello(), 30)
    finally:
        server.close()
        await server.wait_closed()
    assert unhandled == []
