"""ingest(): local paths and URLs into the disk tier, with nothing left behind on failure."""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import SafetensorError

from tests.daemon.formats.layout_check import check_layout, read_raw, torch_raw
from tests.fixtures.cloud import serve_files
from trims.daemon.ingest import DownloadLimits, ingest
from trims.daemon.tiers.disk import DiskTier
from trims.errors import (
    CorruptModel,
    NotFound,
    PayloadTooLarge,
    ResourceExhausted,
    Timeout,
    ValidationError,
)
from trims.layout import Manifest

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

LIMIT = 1 << 30


@pytest.fixture
def disk(tmp_path: Path) -> DiskTier:
    return DiskTier(tmp_path / "disk", budget=1 << 30)


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "model.safetensors"
    path.parent.mkdir()
    st_torch.save_file({"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3)}, path)
    return path


def _nothing_left(disk: DiskTier) -> bool:
    return not list((disk.root / "tmp").iterdir()) and not list((disk.root / "blobs").iterdir())


def _ingest(source: str, disk: DiskTier, **kw: Any) -> Manifest:
    args: dict[str, Any] = {
        "name": "m",
        "version": "1",
        "fmt": None,
        "expected_sha256": None,
        "s3_endpoint": None,
        "progress": None,
        "max_bytes": LIMIT,
    }
    args.update(kw)
    return ingest(source, disk=disk, **args)


def test_local_file(disk: DiskTier, model_file: Path) -> None:
    sha = hashlib.sha256(model_file.read_bytes()).hexdigest()
    room: list[int] = []
    manifest = ingest(
        str(model_file),
        name="m",
        version="1",
        fmt=None,
        expected_sha256=sha.upper(),
        disk=disk,
        s3_endpoint=None,
        progress=None,
        max_bytes=LIMIT,
        make_room=room.append,
    )
    assert room == [manifest.total_bytes]
    assert disk.contains(manifest.digest)
    blob = disk.path(manifest.digest)
    check_layout(blob, manifest)
    assert read_raw(blob, manifest)["w"] == torch_raw(torch.arange(1000, dtype=torch.float32))
    assert not list((disk.root / "tmp").iterdir())


BAD_TOKENS = ["../evil", "a/b", "", ".hidden", "x" * 200, "a..b", "m\n", "m\r", "m\0", "\nm"]


@pytest.mark.parametrize("name", BAD_TOKENS)
def test_bad_names(disk: DiskTier, model_file: Path, name: str) -> None:
    with pytest.raises(ValidationError, match="invalid model name"):
        _ingest(str(model_file), disk, name=name)
    assert _nothing_left(disk)


@pytest.mark.parametrize("version", BAD_TOKENS)
def test_bad_versions(disk: DiskTier, model_file: Path, version: str) -> None:
    with pytest.raises(ValidationError, match="invalid model version"):
        _ingest(str(model_file), disk, version=version)
    assert _nothing_left(disk)


def test_a_digest_with_a_trailing_newline_is_refused(disk: DiskTier, model_file: Path) -> None:
    digest = hashlib.sha256(model_file.read_bytes()).hexdigest()
    with pytest.raises(ValidationError, match="invalid digest"):
        _ingest(str(model_file), disk, expected_sha256=digest + "\n")
    assert _nothing_left(disk)


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("/no/such/file.safetensors", "does not exist"),
        ("ftp://example.com/m.onnx", "unsupported source scheme"),
        ("", "model source"),
        ("a\0b", "model source"),
        ("https://[::1/m.onnx", "malformed URL"),
    ],
)
def test_bad_sources(disk: DiskTier, source: str, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        _ingest(source, disk)
    assert _nothing_left(disk)


def test_directory_is_not_a_model(disk: DiskTier, tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="not a regular file"):
        _ingest(str(tmp_path), disk)


def test_oversize_local_file(disk: DiskTier, model_file: Path) -> None:
    with pytest.raises(PayloadTooLarge, match="over the limit"):
        _ingest(str(model_file), disk, max_bytes=100)
    assert _nothing_left(disk)


def test_sha256_mismatch(disk: DiskTier, model_file: Path) -> None:
    with pytest.raises(CorruptModel, match="sha256"):
        _ingest(str(model_file), disk, expected_sha256="0" * 64)
    assert _nothing_left(disk)


def test_corrupt_file_leaves_nothing(disk: DiskTier, model_file: Path) -> None:
    model_file.write_bytes(model_file.read_bytes()[:-50])
    with pytest.raises(CorruptModel, match="truncated"):
        _ingest(str(model_file), disk)
    assert _nothing_left(disk)


def test_overlapping_safetensors_tensors_are_refused_by_name(
    disk: DiskTier, tmp_path: Path
) -> None:
    """Finding 10a of issue 41: a file whose tensors share bytes, which the safetensors library
    refuses to load, was stored."""
    header = json.dumps(
        {
            "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            "empty": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
            "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
        }
    ).encode()
    source = tmp_path / "overlap.safetensors"
    source.write_bytes(struct.pack("<Q", len(header)) + header + bytes(24))
    with pytest.raises(SafetensorError):
        st_torch.load_file(source)
    with pytest.raises(
        CorruptModel, match=r"tensors 'a' \(bytes \[0, 16\)\) and 'b' \(bytes \[8, 24\)\) overlap"
    ):
        _ingest(str(source), disk)
    assert _nothing_left(disk)


def test_over_budget_leaves_nothing(tmp_path: Path, model_file: Path) -> None:
    disk = DiskTier(tmp_path / "small", budget=100)
    with pytest.raises(ResourceExhausted):
        _ingest(str(model_file), disk)
    assert _nothing_left(disk)


def test_failing_make_room_leaves_nothing(disk: DiskTier, model_file: Path) -> None:
    def refuse(size: int) -> None:
        raise ResourceExhausted(f"cannot free {size} bytes")

    with pytest.raises(ResourceExhausted, match="cannot free"):
        _ingest(str(model_file), disk, make_room=refuse)
    assert _nothing_left(disk)


def test_http_source(disk: DiskTier, model_file: Path) -> None:
    stages: set[str] = set()
    with serve_files({"/models/model.safetensors": model_file.read_bytes()}) as base:
        manifest = _ingest(
            f"{base}/models/model.safetensors",
            disk,
            progress=lambda stage, done, total: stages.add(stage),
        )
    assert stages == {"download", "convert", "verify"}
    assert disk.contains(manifest.digest)
    assert not list((disk.root / "tmp").iterdir())


def test_http_onnx_source_format_from_the_url(
    disk: DiskTier, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trims.daemon")
    onnx = pytest.importorskip("onnx")
    from onnx import helper, numpy_helper

    weight = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "w")
    model = helper.make_model(helper.make_graph([], "g", [], [], [weight]))
    with serve_files({"/zoo/tiny.onnx": model.SerializeToString()}) as base:
        manifest = _ingest(f"{base}/zoo/tiny.onnx?token=secret", disk)
    assert manifest.framework == "onnx"
    assert "tiny.onnx" in caplog.text and "secret" not in caplog.text
    assert manifest.names == ["w", "__onnx_graph__"]
    assert (
        read_raw(disk.path(manifest.digest), manifest)["w"][2]
        == onnx.numpy_helper.to_array(weight).tobytes()
    )


def test_http_source_cut_mid_body_leaves_nothing(disk: DiskTier, model_file: Path) -> None:
    with (
        serve_files({"/m.safetensors": model_file.read_bytes()}, cut=True) as base,
        pytest.raises(CorruptModel, match="connection cut"),
    ):
        _ingest(f"{base}/m.safetensors", disk)
    assert _nothing_left(disk)


def test_a_trickling_download_is_cut_off_and_leaves_nothing(disk: DiskTier) -> None:
    with (
        serve_files({}) as base,
        pytest.raises(Timeout, match="deadline of 1 s") as info,
    ):
        _ingest(f"{base}/trickle?token=secret", disk, limits=DownloadLimits(deadline=1.0))
    assert f"{base}/trickle" in str(info.value) and "secret" not in str(info.value)
    assert _nothing_left(disk)


def _onnx_with_external_data(folder: Path, location: str) -> tuple[bytes, dict[str, bytes]]:
    """An ONNX model whose two weights live in ``location`` beside it: (graph, files)."""
    onnx = pytest.importorskip("onnx")
    from onnx import helper, numpy_helper

    w = numpy_helper.from_array(np.arange(4096, dtype=np.float32).reshape(64, 64), "w")
    b = numpy_helper.from_array(np.full(64, 0.5, dtype=np.float32), "b")
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 64])
    node = helper.make_node("Gemm", ["x", "w", "b"], ["y"])
    model = helper.make_model(helper.make_graph([node], "g", [x], [y], [w, b]))
    (folder / location).parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(
        model, str(folder / "m.onnx"), save_as_external_data=True, location=location,
        size_threshold=0,
    )  # fmt: skip
    return (folder / "m.onnx").read_bytes(), {location: (folder / location).read_bytes()}


def test_remote_onnx_brings_its_external_data_from_beside_it(
    disk: DiskTier, tmp_path: Path
) -> None:
    graph, data = _onnx_with_external_data(tmp_path, "data/weights.bin")
    served = {"/zoo/m.onnx": graph, "/zoo/data/weights.bin": data["data/weights.bin"]}
    with serve_files(served) as base:
        manifest = _ingest(f"{base}/zoo/m.onnx?token=t", disk)
    local = _ingest(str(tmp_path / "m.onnx"), disk, version="2")
    raw = read_raw(disk.path(manifest.digest), manifest)
    assert raw["w"][2] == np.arange(4096, dtype=np.float32).tobytes()
    assert raw["b"][2] == np.full(64, 0.5, dtype=np.float32).tobytes()
    assert manifest.digest == local.digest  # the same layout as the model read from disk
    assert not list((disk.root / "tmp").iterdir())


def test_remote_onnx_with_missing_external_data_names_the_file_and_leaves_nothing(
    disk: DiskTier, tmp_path: Path
) -> None:
    graph, _ = _onnx_with_external_data(tmp_path, "weights.bin")
    with (
        serve_files({"/zoo/m.onnx": graph}) as base,
        pytest.raises(NotFound, match=r"weights\.bin"),
    ):
        _ingest(f"{base}/zoo/m.onnx", disk)
    assert _nothing_left(disk)


def test_remote_onnx_external_data_outside_its_folder_is_refused_before_fetching(
    disk: DiskTier, tmp_path: Path
) -> None:
    onnx = pytest.importorskip("onnx")
    graph, data = _onnx_with_external_data(tmp_path, "weights.bin")
    model = onnx.load_from_string(graph)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../secrets/weights.bin"
    served = {"/zoo/m.onnx": model.SerializeToString(), "/secrets/weights.bin": data["weights.bin"]}
    with (
        serve_files(served) as base,
        pytest.raises(ValidationError, match=r"'\.\./secrets/weights\.bin'.*relative path"),
    ):
        _ingest(f"{base}/zoo/m.onnx", disk)
    assert _nothing_left(disk)


def test_remote_onnx_and_its_data_share_the_size_limit(disk: DiskTier, tmp_path: Path) -> None:
    graph, data = _onnx_with_external_data(tmp_path, "weights.bin")
    served = {"/m.onnx": graph, "/weights.bin": data["weights.bin"]}
    with serve_files(served) as base, pytest.raises(PayloadTooLarge):
        _ingest(f"{base}/m.onnx", disk, max_bytes=len(graph) + 1000)
    assert _nothing_left(disk)


def test_s3_onnx_brings_its_external_data_from_beside_it(
    disk: DiskTier, tmp_path: Path, s3: tuple[str, Any]
) -> None:
    endpoint, client = s3
    graph, data = _onnx_with_external_data(tmp_path, "weights.bin")
    client.put_object(Bucket="models", Key="zoo/m.onnx", Body=graph)
    client.put_object(Bucket="models", Key="zoo/weights.bin", Body=data["weights.bin"])
    manifest = _ingest("s3://models/zoo/m.onnx", disk, s3_endpoint=endpoint)
    raw = read_raw(disk.path(manifest.digest), manifest)
    assert raw["w"][2] == np.arange(4096, dtype=np.float32).tobytes()
    assert not list((disk.root / "tmp").iterdir())


@pytest.mark.parametrize("path", ["/zoo/", "/zoo/..", "/zoo/."])
def test_url_without_a_file_name_is_fetched_inside_the_ingest_folder(
    disk: DiskTier, model_file: Path, path: str
) -> None:
    with serve_files({path: model_file.read_bytes()}) as base:
        manifest = _ingest(base + path, disk, fmt="safetensors")
    assert disk.contains(manifest.digest)
    assert not list((disk.root / "tmp").iterdir())


def test_download_limits_come_from_flags_then_environment() -> None:
    import argparse

    from trims.daemon.cli import build_settings, configure

    parser = argparse.ArgumentParser()
    configure(parser)
    env = {"TRIMS_DOWNLOAD_DEADLINE": "120", "TRIMS_DOWNLOAD_STALL_TIMEOUT": "5"}
    args = parser.parse_args(["--download-deadline", "30"])
    settings = build_settings(args, env)[0]
    assert (settings.download_deadline, settings.download_stall_timeout) == (30.0, 5.0)
    defaults = build_settings(parser.parse_args([]), {})[0]
    assert (defaults.download_deadline, defaults.download_stall_timeout) == (3600.0, 60.0)
    for bad in (["--download-deadline", "soon"], ["--download-stall-timeout", "0"]):
        with pytest.raises(ValidationError, match="download"):
            build_settings(parser.parse_args(bad), {})
