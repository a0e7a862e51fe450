"""PyTorch state dicts -> canonical layout, loaded with weights_only=True."""

from __future__ import annotations

import logging
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


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_roundtrip_is_bit_exact(tmp_path: Path, zipped: bool) -> None:
    tensors = sample_torch_tensors()
    source = tmp_path / "m.pt"
    torch.save(tensors, source, _use_new_zipfile_serialization=zipped)
    manifest = convert(source, tmp_path / "out", name="m", version="1")
    check_layout(tmp_path / "out", manifest)
    assert manifest.framework == "torch"
    assert manifest.metadata["source_format"] == "torch"
    assert manifest.names == list(tensors)
    assert read_raw(tmp_path / "out", manifest) == {k: torch_raw(v) for k, v in tensors.items()}


def test_checkpoint_is_flattened_and_non_tensors_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trims.daemon.formats.torch_fmt")
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    checkpoint = {
        "model": model.state_dict(),
        "epoch": 3,
        "note": "best",
        "extra": [torch.zeros(2), {"k": torch.ones(1, dtype=torch.int64)}],
    }
    source = tmp_path / "ckpt.pth"
    torch.save(checkpoint, source)
    manifest = convert(source, tmp_path / "out", name="m", version="1")
    assert manifest.names == [
        "model.0.weight",
        "model.0.bias",
        "model.1.weight",
        "model.1.bias",
        "extra.0",
        "extra.1.k",
    ]
    got = read_raw(tmp_path / "out", manifest)
    assert got["model.0.weight"] == torch_raw(model[0].weight)
    assert "'epoch' is a int, not a tensor; skipped" in caplog.text


def test_pickled_module_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "module.pt"
    torch.save(torch.nn.Linear(2, 2), source)
    with pytest.raises(ValidationError, match="state_dict"):
        convert(source, tmp_path / "out", name="m", version="1")
    assert not (tmp_path / "out").exists()


def test_truncated_file_is_corrupt(tmp_path: Path) -> None:
    source = tmp_path / "m.pt"
    torch.save({"w": torch.ones(4096)}, source)
    source.write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    with pytest.raises(CorruptModel, match=str(source)):
        convert(source, tmp_path / "out", name="m", version="1")
    assert not (tmp_path / "out").exists()


def test_garbage_is_corrupt(tmp_path: Path) -> None:
    source = tmp_path / "m.pt"
    source.write_bytes(b"this is not a pickle" * 10)
    with pytest.raises(CorruptModel):
        convert(source, tmp_path / "out", name="m", version="1")


def test_no_tensors(tmp_path: Path) -> None:
    source = tmp_path / "m.pt"
    torch.save({"epoch": 1}, source)
    with pytest.raises(ValidationError, match="no tensors"):
        convert(source, tmp_path / "out", name="m", version="1")


def test_unsupported_dtype(tmp_path: Path) -> None:
    source = tmp_path / "m.pt"
    torch.save({"w": torch.zeros(3).to(torch.float8_e4m3fn)}, source)
    with pytest.raises(ValidationError, match="float8_e4m3fn"):
        convert(source, tmp_path / "out", name="m", version="1")
    assert not (tmp_path / "out").exists()


def _zip(path: Path, entries: dict[str, int]) -> Path:
    """A zip checkpoint's shape: entries of the given sizes (zeros, compressed)."""
    import zipfile

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, size in entries.items():
            z.writestr(name, bytes(size))
    return path


def test_a_huge_pickle_is_refused_before_it_is_unpickled(tmp_path: Path) -> None:
    from trims.daemon.formats.torch_fmt import MAX_PICKLE
    from trims.errors import PayloadTooLarge

    source = _zip(tmp_path / "m.pt", {"m/data.pkl": MAX_PICKLE + 1})
    with pytest.raises(PayloadTooLarge, match=f"{MAX_PICKLE + 1} bytes, over the limit"):
        convert(source, tmp_path / "out", name="m", version="1")
    assert not (tmp_path / "out").exists()


def test_too_many_storages_are_refused_before_they_are_loaded(tmp_path: Path) -> None:
    from trims.errors import PayloadTooLarge
    from trims.layout import MAX_TENSORS

    entries = {"m/data.pkl": 16, **{f"m/data/{i}": 0 for i in range(MAX_TENSORS + 1)}}
    source = _zip(tmp_path / "m.pt", entries)
    with pytest.raises(PayloadTooLarge, match=f"holds {MAX_TENSORS + 1} tensors"):
        convert(source, tmp_path / "out", name="m", version="1")
    assert not (tmp_path / "out").exists()


def test_too_many_tensors_are_refused(tmp_path: Path) -> None:
    from trims.errors import PayloadTooLarge
    from trims.layout import MAX_TENSORS

    shared = torch.zeros(0)  # one storage, many tensors: the storage count alone allows it
    source = tmp_path / "m.pt"
    torch.save([shared] * (MAX_TENSORS + 1), source)
    with pytest.raises(PayloadTooLarge, match=f"holds {MAX_TENSORS + 1} tensors"):
        convert(source, tmp_path / "out", name="m", version="1")
    assert not (tmp_path / "out").exists()
