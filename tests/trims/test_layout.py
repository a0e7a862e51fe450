"""The canonical layout: planning, manifest validation, digests."""

from __future__ import annotations

import io

import pytest

from trims import layout
from trims.errors import CorruptModel, ValidationError


def _manifest(**over: object) -> dict[str, object]:
    entries, total = layout.plan(
        [layout.TensorSpec("w", "float32", (3, 5)), layout.TensorSpec("b", "float16", (5,))]
    )
    d: dict[str, object] = {
        "name": "m",
        "version": "1",
        "digest": "0" * 64,
        "framework": "torch",
        "total_bytes": total,
        "tensors": [e.to_dict() for e in entries],
    }
    d.update(over)
    return d


def test_plan_aligns_every_tensor_and_rounds_to_a_page() -> None:
    specs = [
        layout.TensorSpec("a", "float32", (3,)),
        layout.TensorSpec("b", "int8", (1,)),
        layout.TensorSpec("c", "float64", (2, 2)),
        layout.TensorSpec("scalar", "bool", ()),
        layout.TensorSpec("empty", "float32", (0, 4)),
    ]
    entries, total = layout.plan(specs)
    assert [e.offset for e in entries] == [0, 64, 128, 192, 256]
    assert [e.nbytes for e in entries] == [12, 1, 32, 1, 0]
    assert total == 4096


def test_plan_rejects_duplicates_and_unknown_dtypes() -> None:
    with pytest.raises(ValidationError, match="duplicate"):
        layout.plan([layout.TensorSpec("a", "float32", (1,))] * 2)
    with pytest.raises(ValidationError, match="unsupported dtype"):
        layout.plan([layout.TensorSpec("a", "float128", (1,))])


def test_manifest_round_trip() -> None:
    m = layout.Manifest.from_dict(_manifest())
    assert layout.Manifest.from_dict(m.to_dict()) == m
    assert m.tensor("b").dtype == "float16"
    assert m.names == ["w", "b"]


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"name": "../etc"}, "invalid model name"),
        ({"name": "a/b"}, "invalid model name"),
        ({"digest": "xyz"}, "invalid digest"),
        ({"total_bytes": 10}, "past the buffer"),
        ({"layout_version": 99}, "not supported"),
        ({"tensors": [{"name": "w", "dtype": "float32", "shape": [2], "offset": 3, "nbytes": 8}]},
         "multiple of 64"),
        ({"tensors": [{"name": "w", "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 9}]},
         "does not match"),
        ({"tensors": [{"name": "w", "dtype": "float32", "shape": [-1], "offset": 0, "nbytes": 0}]},
         "invalid shape"),
        ({"tensors": [{"name": "w", "dtype": "float32", "shape": [16], "offset": 0, "nbytes": 64},
                      {"name": "v", "dtype": "float32", "shape": [16], "offset": 0, "nbytes": 64}]},
         "overlaps"),
        ({"tensors": [{"name": "w"}]}, "lacks field"),
    ],
)  # fmt: skip
def test_manifest_validation_says_what_is_wrong(override: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        layout.Manifest.from_dict(_manifest(**override))


def test_sha256_stream_detects_truncation() -> None:
    data = b"x" * 1000
    assert layout.sha256_stream(io.BytesIO(data), 1000) == layout.sha256_buffer(data)
    with pytest.raises(CorruptModel, match="truncated"):
        layout.sha256_stream(io.BytesIO(data), 2000)


@pytest.mark.parametrize("name", ["resnet50", "bert-base.v2", "A_1"])
def test_good_names(name: str) -> None:
    assert layout.validate_model_name(name) == name


@pytest.mark.parametrize("name", ["", ".hidden", "a..b", "x" * 200, "a b", 5, None])
def test_bad_names(name: object) -> None:
    with pytest.raises(ValidationError):
        layout.validate_model_name(name)


def test_format_from_suffix_is_case_insensitive_and_says_none_for_unknown() -> None:
    from trims.layout import MODEL_FORMATS, format_from_suffix

    assert format_from_suffix("dir/Model.SafeTensors") == "safetensors"
    assert format_from_suffix("w.pth") == format_from_suffix("w.ckpt") == "torch"
    assert format_from_suffix("m.onnx") == "onnx" and format_from_suffix("m.params") == "mxnet"
    assert format_from_suffix("model.h5") is None and format_from_suffix("model") is None
    named = {format_from_suffix(f"x{s}") for s in (".safetensors", ".pt", ".onnx", ".params")}
    assert named == set(MODEL_FORMATS)
