"""Format detection and the convert() entry point's own checks."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from trims.daemon.formats import FORMATS, convert, detect_format
from trims.errors import ValidationError


@pytest.mark.parametrize(
    ("filename", "content", "fmt"),
    [
        ("weights.bin", struct.pack("<Q", 2) + b"{}", "safetensors"),
        ("weights", b"PK\x03\x04" + b"\0" * 20, "torch"),
        ("model.data", struct.pack("<QQ", 0x112, 0), "mxnet"),
        ("model.onnx", b"\x08\x07\x12\x04", "onnx"),
        ("model.pth", b"\x80\x02junk", "torch"),
        ("model.params", b"", "mxnet"),
    ],
)
def test_detect_format(tmp_path: Path, filename: str, content: bytes, fmt: str) -> None:
    path = tmp_path / filename
    path.write_bytes(content)
    assert detect_format(path) == fmt


def test_download_name_supplies_the_suffix(tmp_path: Path) -> None:
    path = tmp_path / "0123.part"
    path.write_bytes(b"\x08\x07")
    assert detect_format(path, filename="resnet.onnx") == "onnx"
    with pytest.raises(ValidationError, match=r"cannot tell the format of 0123\.part"):
        detect_format(path)


def test_convert_checks_its_arguments(tmp_path: Path) -> None:
    source = tmp_path / "m.safetensors"
    source.write_bytes(struct.pack("<Q", 2) + b"{}")
    with pytest.raises(ValidationError, match="invalid model name"):
        convert(source, tmp_path / "out", name="../x", version="1")
    with pytest.raises(ValidationError, match="invalid model version"):
        convert(source, tmp_path / "out", name="m", version="1/2")
    with pytest.raises(ValidationError, match="unknown model format 'tf'"):
        convert(source, tmp_path / "out", name="m", version="1", fmt="tf")
    with pytest.raises(ValidationError, match="not a regular file"):
        convert(tmp_path, tmp_path / "out", name="m", version="1")
    assert not (tmp_path / "out").exists()
    assert set(FORMATS) == {"safetensors", "torch", "onnx", "mxnet"}


def test_a_model_without_tensors_still_has_a_page(tmp_path: Path) -> None:
    source = tmp_path / "m.safetensors"
    source.write_bytes(struct.pack("<Q", 2) + b"{}")
    manifest = convert(source, tmp_path / "out", name="m", version="1")
    assert manifest.tensors == () and manifest.total_bytes == 4096
    assert (tmp_path / "out").read_bytes() == bytes(4096)
