"""Bounds at ingest, through a real daemon: a model too big to describe in one reply is refused
at ``add`` (and the daemon keeps serving), and the largest model it accepts is served."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.store import DaemonProcess
from trims import layout
from trims.errors import NotFound, PayloadTooLarge
from trims.protocol import MAX_FRAME


def _safetensors(path: Path, entries: dict[str, dict[str, Any]], data: bytes = b"") -> Path:
    header = json.dumps(entries, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def _zero_size(names: list[str], shape: list[int]) -> dict[str, dict[str, Any]]:
    return {n: {"dtype": "F64", "shape": shape, "data_offsets": [0, 0]} for n in names}


def _error(reply: dict[str, Any]) -> dict[str, Any]:
    assert reply["ok"] is False, reply
    error: dict[str, Any] = reply["error"]
    return error


def _still_serving(daemon: DaemonProcess, tmp_path: Path) -> None:
    """The daemon answers, and a normal add and acquire still work."""
    assert daemon.request("hello")["ok"]
    small = _safetensors(
        tmp_path / "small.safetensors",
        {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
        struct.pack("<2f", 1.0, 2.0),
    )
    assert daemon.request("add", admin=True, name="small", source=str(small))["ok"]
    assert daemon.request("acquire", name="small")["ok"]


def test_300000_zero_size_tensors_are_refused_at_add(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    daemon = start_daemon()
    source = _safetensors(
        tmp_path / "many.safetensors", _zero_size([f"t{i}" for i in range(300_000)], [0])
    )
    error = _error(daemon.request("add", admin=True, name="many", source=str(source)))
    assert error["code"] == PayloadTooLarge.code
    assert (
        "300000 tensors" in error["message"] and f"at most {layout.MAX_TENSORS}" in error["message"]
    )
    assert error["details"] == {"size": 300_000, "limit": layout.MAX_TENSORS}
    assert _error(daemon.request("info", name="many"))["code"] == NotFound.code
    _still_serving(daemon, tmp_path)


def test_a_header_over_its_limit_is_refused_before_it_is_read(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    from trims.daemon.formats.safetensors_fmt import MAX_HEADER

    daemon = start_daemon()
    source = tmp_path / "huge.safetensors"
    with open(source, "wb") as f:  # sparse: the length is announced, the bytes are holes
        f.write(struct.pack("<Q", MAX_HEADER + 1) + b"{")
        f.truncate(8 + MAX_HEADER + 1)
    error = _error(daemon.request("add", admin=True, name="huge", source=str(source)))
    assert error["code"] == PayloadTooLarge.code
    assert f"{MAX_HEADER + 1} bytes, over the limit of {MAX_HEADER}" in error["message"]
    _still_serving(daemon, tmp_path)


def _largest_model(tmp_path: Path) -> tuple[Path, int]:
    """A safetensors file whose manifest is just under MAX_MANIFEST_JSON: names of 504 bytes
    of UTF-8 that JSON escapes to 1002, shapes of 8 dimensions, zero-size tensors."""
    stem = "\u20ac" * 166
    shape = [0, *[layout.MAX_TOTAL_BYTES] * (layout.MAX_NDIM - 1)]

    def manifest_size(count: int) -> int:
        specs = [layout.TensorSpec(f"{stem}{i:06d}", "float64", tuple(shape)) for i in range(count)]
        entries, total = layout.plan(specs)
        m = layout.Manifest("largest", "1", "0" * 64, "safetensors", total, entries,
                            metadata={"source_format": "safetensors"})  # fmt: skip
        return len(json.dumps(m.to_dict(), separators=(",", ":")))

    per_tensor = manifest_size(2) - manifest_size(1)
    count = (layout.MAX_MANIFEST_JSON - manifest_size(0)) // per_tensor
    assert layout.MAX_MANIFEST_JSON - per_tensor < manifest_size(count) <= layout.MAX_MANIFEST_JSON
    names = [f"{stem}{i:06d}" for i in range(count)]
    return _safetensors(tmp_path / "largest.safetensors", _zero_size(names, shape)), count


def test_the_largest_allowed_manifest_is_served_by_info_and_acquire(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    daemon = start_daemon()
    source, count = _largest_model(tmp_path)
    added = daemon.request("add", admin=True, name="largest", source=str(source))
    assert added["ok"], added
    for admin in (False, True):
        info = daemon.request("info", admin=admin, name="largest")
        assert info["ok"], info
        manifest = layout.Manifest.from_dict(info["result"]["model"]["manifest"])
        assert len(manifest.tensors) == count
    acquired = daemon.request("acquire", name="largest", tier="cpu")
    assert acquired["ok"], acquired
    manifest = layout.Manifest.from_dict(acquired["result"]["manifest"])
    assert manifest.names[-1] == f"{'€' * 166}{count - 1:06d}"
    reply = json.dumps(acquired, separators=(",", ":"))
    assert layout.MAX_MANIFEST_JSON - 1500 < len(reply) <= MAX_FRAME


def test_one_more_tensor_is_refused_with_the_size_and_the_limit(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    daemon = start_daemon()
    source, count = _largest_model(tmp_path)
    header = json.loads(source.read_bytes()[8:])
    header["x" * 500] = {"dtype": "F64", "shape": [0] * 8, "data_offsets": [0, 0]}
    header["y" * 500] = {"dtype": "F64", "shape": [0] * 8, "data_offsets": [0, 0]}
    bigger = _safetensors(tmp_path / "bigger.safetensors", header)
    error = _error(daemon.request("add", admin=True, name="bigger", source=str(bigger)))
    assert error["code"] == PayloadTooLarge.code
    assert f"over the limit of {layout.MAX_MANIFEST_JSON}" in error["message"]
    assert f"({count + 2} tensors)" in error["message"]
    _still_serving(daemon, tmp_path)


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ({"dtype": "F32", "shape": [1] * 9, "data_offsets": [0, 4]}, "invalid shape"),
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}, "invalid shape"),
    ],
)
def test_bad_shapes_are_refused_at_add(
    start_daemon: Callable[..., DaemonProcess],
    tmp_path: Path,
    entry: dict[str, Any],
    needle: str,
) -> None:
    daemon = start_daemon()
    source = _safetensors(tmp_path / "bad.safetensors", {"w": entry}, bytes(4))
    error = _error(daemon.request("add", admin=True, name="bad", source=str(source)))
    assert needle in error["message"]
