"""What a user is told about a file that is not the model format its name or --format says."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trims.daemon.formats import convert, detect_format
from trims.errors import CorruptModel, ValidationError
from trims.layout import FORMAT_SUFFIXES, MODEL_FORMATS


def test_random_bytes_named_pt_are_not_a_pytorch_file(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    source = tmp_path / "model.pt"
    data = bytearray(b"\x13\x37" + os.urandom(4094))
    # Bytes that match no format's magic: a "{" at offset 8 reads as a safetensors header
    # (1 random file in 256 did, and failed this test on the safetensors path).
    data[8] = 0
    source.write_bytes(bytes(data))
    with pytest.raises(CorruptModel) as refused:
        convert(source, tmp_path / "out", name="m", version="1")
    message = refused.value.message
    assert "is not a PyTorch file" in message and "starts with 13 37" in message
    assert "other than tensors" not in message
    assert not (tmp_path / "out").exists()


def test_an_empty_pt_file_says_it_is_empty(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    source = tmp_path / "model.pt"
    source.write_bytes(b"")
    with pytest.raises(CorruptModel, match="the file is empty"):
        convert(source, tmp_path / "out", name="m", version="1", fmt="torch")


def test_a_legacy_pickle_checkpoint_still_converts(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    source = tmp_path / "old.pt"
    torch.save({"w": torch.ones(3)}, source, _use_new_zipfile_serialization=False)
    manifest = convert(source, tmp_path / "out", name="m", version="1")
    assert [t.name for t in manifest.tensors] == ["w"]


def test_an_unknown_suffix_names_format_and_every_accepted_one(tmp_path: Path) -> None:
    source = tmp_path / "weights.dat"
    source.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValidationError) as refused:
        detect_format(source)
    message = refused.value.message
    assert "--format" in message
    for suffix in FORMAT_SUFFIXES:
        assert suffix in message
    assert ", ".join(MODEL_FORMATS) in message
