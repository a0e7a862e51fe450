"""The canonical layout: planning, manifest validation, digests."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest

from trims import layout
from trims.errors import CorruptModel, PayloadTooLarge, ValidationError
from trims.protocol import MAX_FRAME, encode_frame


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


BAD_TOKENS = ["name\n", "name\r", "na\0me", "../x", "", "x" * 200, "a\n", "\nname", "name\r\n"]


@pytest.mark.parametrize("name", BAD_TOKENS)
def test_names_with_a_trailing_newline_or_traversal_are_refused(name: str) -> None:
    with pytest.raises(ValidationError, match="invalid model name"):
        layout.validate_model_name(name)


@pytest.mark.parametrize("version", [*BAD_TOKENS, "1.0+cu1\n", "1" * 65])
def test_versions_are_matched_in_full(version: str) -> None:
    with pytest.raises(ValidationError, match="invalid model version"):
        layout.validate_version(version)
    assert layout.validate_version("1.2.0+cu121") == "1.2.0+cu121"


@pytest.mark.parametrize(
    "digest", ["0" * 64 + "\n", "0" * 64 + "\r", "0" * 63 + "\0", "", "A" * 64]
)
def test_digests_are_matched_in_full(digest: str) -> None:
    with pytest.raises(ValidationError, match="invalid digest"):
        layout.validate_digest(digest)


@pytest.mark.parametrize(
    ("name", "needle"),
    [("w\n", "control characters"), ("w\0", "control characters"), ("", "empty"),
     ("é" * 257, "514 bytes"), ("\ud800", "not valid UTF-8"), (5, "must be a string")],
)  # fmt: skip
def test_tensor_names_are_bounded_and_printable(name: object, needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        layout.validate_tensor_name(name)
    assert layout.validate_tensor_name("é" * 256) == "é" * 256


def _entry(name: str, offset: int, n: int, shape: list[int] | None = None) -> dict[str, object]:
    return {"name": name, "dtype": "uint8", "shape": shape or [n], "offset": offset, "nbytes": n}


@pytest.mark.parametrize(
    ("tensors", "needle"),
    [
        # partial overlap, tensors listed in either order
        ([_entry("a", 0, 128), _entry("b", 64, 128)], "'b' .*overlaps tensor 'a'"),
        ([_entry("b", 64, 128), _entry("a", 0, 128)], "'b' .*overlaps tensor 'a'"),
        # one tensor inside another, and an overlap hidden behind a zero-size tensor
        ([_entry("big", 0, 1024), _entry("in", 256, 64)], "'in' .*overlaps tensor 'big'"),
        ([_entry("a", 0, 256), _entry("z", 64, 0, [0]), _entry("c", 128, 64)], "'c' .*overlaps"),
        # same offset, the longer one listed first
        ([_entry("a", 0, 128), _entry("b", 0, 64)], "overlaps"),
        ([_entry("a", 4096, 64)], "past the buffer"),
        ([_entry("a", 1 << 50, 0, [0])], "invalid offset"),
        ([_entry("a", 32, 8)], "multiple of 64"),
        ([_entry("a", 0, 0, [0, -1])], "invalid shape"),
        ([_entry("a", 0, 0, [0, 1 << 60])], "between 0 and"),
        ([_entry("a", 0, 0, [1] * 8 + [0])], "9 dimensions"),
        ([_entry("a", 0, 8, [True] * 8)], "invalid shape"),
        ([{**_entry("a", 0, 4), "nbytes": 4.0}], "invalid nbytes"),
        ([{**_entry("a", 0, 4), "dtype": ["uint8"]}], "unknown dtype"),
    ],
)
def test_manifest_tensor_ranges_are_checked(tensors: list[object], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        layout.Manifest.from_dict(_manifest(tensors=tensors, total_bytes=4096))


def test_zero_size_tensors_overlap_nothing() -> None:
    tensors = [_entry("a", 0, 128), _entry("z", 64, 0, [0]), _entry("y", 128, 0, [2, 0])]
    m = layout.Manifest.from_dict(_manifest(tensors=tensors, total_bytes=4096))
    assert m.names == ["a", "z", "y"]


@pytest.mark.parametrize(
    ("override", "needle"),
    [({"alignment": 1}, "power of two"), ({"alignment": 96}, "power of two"),
     ({"alignment": 0}, "power of two"), ({"alignment": "64"}, "alignment '64' must be an int"),
     ({"layout_version": [1]}, "must be an int"), ({"total_bytes": True}, "total_bytes"),
     ({"total_bytes": 1 << 60}, "total_bytes"), ({"framework": "x" * 65}, "framework"),
     ({"framework": 7}, "framework"), ({"metadata": {"k": 1}}, "object of strings")],
)  # fmt: skip
def test_manifest_header_fields_are_checked(override: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        layout.Manifest.from_dict(_manifest(**override))


def test_too_many_tensors_are_refused_before_they_are_parsed() -> None:
    tensors = [{}] * (layout.MAX_TENSORS + 1)  # not even valid entries: the count comes first
    with pytest.raises(PayloadTooLarge, match=f"{layout.MAX_TENSORS + 1} tensors") as info:
        layout.Manifest.from_dict(_manifest(tensors=tensors))
    assert info.value.details == {"size": layout.MAX_TENSORS + 1, "limit": layout.MAX_TENSORS}
    specs = (layout.TensorSpec(f"t{i}", "uint8", (0,)) for i in range(layout.MAX_TENSORS + 1))
    with pytest.raises(PayloadTooLarge, match="at most 65536"):
        layout.plan(specs)


def test_plan_checks_names_and_shapes() -> None:
    with pytest.raises(ValidationError, match="control characters"):
        layout.plan([layout.TensorSpec("a\nb", "float32", (1,))])
    with pytest.raises(ValidationError, match="dimensions"):
        layout.plan([layout.TensorSpec("a", "float32", (1,) * 9)])
    with pytest.raises(ValidationError, match="needs"):
        layout.plan([layout.TensorSpec("a", "float64", (1 << 46,))])


def test_oversized_metadata_is_refused() -> None:
    metadata = {"k": "x" * layout.MAX_METADATA_JSON}
    with pytest.raises(PayloadTooLarge, match="metadata"):
        layout.Manifest.from_dict(_manifest(metadata=metadata))


def _largest_manifest() -> layout.Manifest:
    """A manifest just under MAX_MANIFEST_JSON: the longest names, escaped as much as JSON
    escapes (3 bytes of UTF-8 -> 6 of JSON), 8-dimensional shapes with 15-digit dims."""
    stem = "\u20ac" * (layout.MAX_TENSOR_NAME // 3 - 2)  # 3 UTF-8 bytes each, 6 in JSON
    shape = (0, *[layout.MAX_TOTAL_BYTES] * (layout.MAX_NDIM - 1))

    def entry(i: int) -> layout.TensorEntry:
        return layout.TensorEntry(f"{stem}{i:06d}", "complex128", shape, 1 << 47, 0)

    empty = layout.Manifest("m" * 128, "v" * 64, "f" * 64, "x" * 64, layout.MAX_TOTAL_BYTES, ())
    base = len(json.dumps(empty.to_dict(), separators=(",", ":")))
    per_tensor = len(json.dumps(entry(0).to_dict(), separators=(",", ":"))) + 1
    count = min(layout.MAX_TENSORS, (layout.MAX_MANIFEST_JSON - base) // per_tensor)
    return dataclasses.replace(empty, tensors=tuple(entry(i) for i in range(count)))


def test_the_largest_manifest_fits_in_one_reply_frame() -> None:
    """Note [manifest bounds]: MAX_MANIFEST_JSON plus the worst rest of an info or acquire
    reply (an admin's info: a source of 4096 astral characters, 12 JSON bytes each, 2 x 1024
    access ids) fits in MAX_FRAME."""
    m = _largest_manifest()
    layout.Manifest.from_dict(m.to_dict())  # allowed
    size = len(json.dumps(m.to_dict(), separators=(",", ":")))
    assert layout.MAX_MANIFEST_JSON - size < 4096  # at the limit, not far below it
    ids = list(range(4_294_967_295 - 1024, 4_294_967_295))
    model = {
        "name": m.name, "version": m.version, "digest": m.digest, "framework": m.framework,
        "format": "safetensors", "total_bytes": m.total_bytes, "added_at": 1e18,
        "tiers": ["gpu", "cpu", "disk"], "pins": ["gpu", "cpu", "disk"], "leases": 1 << 62,
        "source": "\U0001f600" * 4096, "access": {"uids": ids, "gids": ids},
        "manifest": m.to_dict(),
    }  # fmt: skip
    info = {"id": 1 << 62, "ok": True, "result": {"model": model}}
    handle = {"kind": "cuda_vmm", "size": 1 << 48, "device": "GPU-" + "f" * 36, "uuid": "x" * 64}
    acquire = {
        "id": 1 << 62,
        "ok": True,
        "result": {"lease": "l" * 64, "tier": "gpu", "manifest": m.to_dict(), "handle": handle},
    }
    for reply in (info, acquire):
        assert len(encode_frame(reply, 1)) <= MAX_FRAME + 64
    rest = len(json.dumps(info, separators=(",", ":"))) - size
    assert layout.MAX_MANIFEST_JSON + rest <= MAX_FRAME


def test_a_manifest_over_the_json_limit_is_refused() -> None:
    m = _largest_manifest()
    extra = tuple(
        layout.TensorEntry(f"extra{i}" + "x" * 500, "uint8", (0,), 0, 0) for i in range(10)
    )
    bigger = dataclasses.replace(m, tensors=m.tensors + extra)
    with pytest.raises(PayloadTooLarge, match="bytes of JSON") as info:
        layout.Manifest.from_dict(bigger.to_dict())
    assert info.value.details["limit"] == layout.MAX_MANIFEST_JSON
