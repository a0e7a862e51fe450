"""MXNet .params -> canonical layout, parsed without MXNet; checked against files MXNet wrote.

The files come from real MXNet 1.9.1, run as a subprocess in its own environment (it needs
numpy<1.24): $TRIMS_MXNET_PYTHON, the current interpreter when it has mxnet, CI's
/tmp/trims-mxnet-venv or /tmp/setup/mxvenv. Tests that need it skip with a reason otherwise.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon.formats.layout_check import check_layout, read_raw
from trims.daemon.formats import convert, detect_format
from trims.errors import CorruptModel, ValidationError

MXNET_PYTHONS = ("/tmp/trims-mxnet-venv/bin/python", "/tmp/setup/mxvenv/bin/python")

# Runs inside the MXNet environment: writes .params files and, for each, a JSON reference of
# every array's dtype, shape and raw bytes (hex) as MXNet itself reads them back.
GENERATE = r"""
import json, sys
import numpy as np
import mxnet as mx
out = sys.argv[1]
bf16 = np.dtype([("bfloat16", np.uint16)])
rng = np.random.default_rng(11)
def dtype(v):
    return "bfloat16" if np.dtype(v.dtype) == bf16 else np.dtype(v.dtype).name
def ref(arrays):
    return {k: [dtype(v), list(v.shape), v.asnumpy().tobytes().hex()] for k, v in arrays.items()}
refs = {}
sym = {
    "arg:conv0_weight": mx.nd.array(rng.standard_normal((4, 3, 3, 3)), dtype="float32"),
    "arg:fc_bias": mx.nd.array(rng.standard_normal(5), dtype="float64"),
    "arg:half": mx.nd.array(rng.standard_normal((2, 7)), dtype="float16"),
    "arg:brain": mx.nd.array(rng.standard_normal(6), dtype="float32").astype(bf16),
    "aux:bn_moving_mean": mx.nd.array(rng.standard_normal(3), dtype="float32"),
    "aux:steps": mx.nd.array([-(2**40), 7, 2**50], dtype="int64"),
    "aux:i32": mx.nd.array([-5, 9], dtype="int32"),
    "aux:i8": mx.nd.array([-128, 127], dtype="int8"),
    "aux:u8": mx.nd.array([0, 255], dtype="uint8"),
    "aux:mask": mx.nd.array([1, 0, 1], dtype="bool"),
}
mx.nd.save(f"{out}/symbolic.params", sym)
refs["symbolic"] = ref(sym)
mx.nd.save(f"{out}/list.params", [mx.nd.ones((2, 2)), mx.nd.zeros((3,), dtype="int64")])
refs["list"] = ref({"0": mx.nd.ones((2, 2)), "1": mx.nd.zeros((3,), dtype="int64")})
net = mx.gluon.nn.HybridSequential()
net.add(mx.gluon.nn.Dense(8, in_units=4), mx.gluon.nn.BatchNorm(in_channels=8))
net.initialize(mx.init.Xavier())
net(mx.nd.ones((2, 4)))
net.save_parameters(f"{out}/gluon.params")
refs["gluon"] = ref(mx.nd.load(f"{out}/gluon.params"))
mx.npx.set_np()
arrays = {"scalar": mx.np.array(3.5), "empty": mx.np.zeros((0, 3)),
          "flags": mx.np.array([[True, False]], dtype="bool")}
mx.npx.save(f"{out}/numpy.params", arrays)
refs["numpy"] = ref(arrays)
json.dump(refs, open(f"{out}/refs.json", "w"))
"""


def _mxnet_python() -> str | None:
    candidates = [os.environ.get("TRIMS_MXNET_PYTHON", ""), *MXNET_PYTHONS]
    try:
        import mxnet  # noqa: F401

        candidates.insert(0, sys.executable)
    except ImportError:
        pass
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


@pytest.fixture(scope="module")
def mxnet_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    python = _mxnet_python()
    if python is None:
        pytest.skip(f"no MXNet environment: set TRIMS_MXNET_PYTHON or create {MXNET_PYTHONS[0]}")
    out = tmp_path_factory.mktemp("mxnet")
    subprocess.run([python, "-c", GENERATE, str(out)], check=True, timeout=120)
    refs: dict[str, object] = json.loads((out / "refs.json").read_text())
    return out, refs


@pytest.mark.mxnet
@pytest.mark.parametrize("name", ["symbolic", "list", "gluon", "numpy"])
def test_files_written_by_mxnet_are_bit_exact(
    tmp_path: Path, mxnet_files: tuple[Path, dict[str, object]], name: str
) -> None:
    folder, refs = mxnet_files
    source = folder / f"{name}.params"
    assert detect_format(source) == "mxnet"
    manifest = convert(source, tmp_path / "out", name="m", version="1")
    check_layout(tmp_path / "out", manifest)
    assert manifest.framework == "mxnet"
    expected = refs[name]
    assert isinstance(expected, dict)
    got = {
        k: [dtype, list(shape), raw.hex()]
        for k, (dtype, shape, raw) in read_raw(tmp_path / "out", manifest).items()
    }
    assert got == expected
    assert manifest.names == list(expected)


@pytest.mark.mxnet
def test_truncated_mxnet_files_are_corrupt(
    tmp_path: Path, mxnet_files: tuple[Path, dict[str, object]]
) -> None:
    data = (mxnet_files[0] / "symbolic.params").read_bytes()
    for cut in (4, 30, 100, len(data) // 2, len(data) - 3):
        source = tmp_path / f"cut{cut}.params"
        source.write_bytes(data[:cut])
        with pytest.raises(CorruptModel, match=str(source)):
            convert(source, tmp_path / "out", name="m", version="1", fmt="mxnet")
        assert not (tmp_path / "out").exists()


# Hand-built files in the same format, for what MXNet itself cannot be made to write.


def _array(shape: tuple[int, ...], flag: int, data: bytes, *, stype: int = 0) -> bytes:
    head = struct.pack("<Iii", 0xF993FAC9, stype, len(shape)) + struct.pack(
        f"<{len(shape)}q", *shape
    )
    return head + struct.pack("<iii", 1, 0, flag) + data


def _file(arrays: list[bytes], names: list[str]) -> bytes:
    out = struct.pack("<QQQ", 0x112, 0, len(arrays)) + b"".join(arrays)
    out += struct.pack("<Q", len(names))
    return out + b"".join(struct.pack("<Q", len(n.encode())) + n.encode() for n in names)


GOOD = _array((2,), 0, b"\0\0\x80?\0\0\0@")


@pytest.mark.parametrize(
    ("content", "error", "words"),
    [
        (_file([GOOD], ["a", "b"]), CorruptModel, "1 arrays but 2 names"),
        (_file([GOOD], ["a"]) + b"junk", CorruptModel, "unexpected bytes"),
        (_file([GOOD], ["a"])[:44], CorruptModel, "truncated"),
        (_file([_array((2,), 99, b"\0" * 8)], ["a"]), ValidationError, "type flag 99"),
        (_file([_array((2,), 0, b"", stype=1)], ["a"]), ValidationError, "row_sparse"),
        (_file([struct.pack("<I", 2) + b"\0" * 24], ["a"]), ValidationError, "legacy"),
        (_file([], []), ValidationError, "no arrays"),
        (struct.pack("<QQQ", 0x112, 0, 1 << 40), CorruptModel, "more than its size"),
    ],
    ids=["names", "trailing", "truncated", "dtype", "sparse", "legacy", "empty", "count"],
)
def test_bad_files(tmp_path: Path, content: bytes, error: type[Exception], words: str) -> None:
    source = tmp_path / "m.params"
    source.write_bytes(content)
    with pytest.raises(error, match=words):
        convert(source, tmp_path / "out", name="m", version="1")
    assert not (tmp_path / "out").exists()


def test_none_arrays_are_skipped(tmp_path: Path) -> None:
    none = struct.pack("<Iii", 0xF993FAC9, 0, 0)
    source = tmp_path / "m.params"
    source.write_bytes(_file([none, GOOD], ["gone", "kept"]))
    manifest = convert(source, tmp_path / "out", name="m", version="1")
    assert read_raw(tmp_path / "out", manifest) == {"kept": ("float32", (2,), b"\0\0\x80?\0\0\0@")}


def test_too_many_arrays_are_refused_before_they_are_read(tmp_path: Path) -> None:
    from trims.errors import PayloadTooLarge
    from trims.layout import MAX_TENSORS

    count = MAX_TENSORS + 1
    source = tmp_path / "many.params"
    source.write_bytes(struct.pack("<QQQ", 0x112, 0, count) + bytes(12 * count))
    with pytest.raises(PayloadTooLarge, match=f"holds {count} tensors; .* at most {MAX_TENSORS}"):
        convert(source, tmp_path / "out", name="m", version="1")
    assert not (tmp_path / "out").exists()


def test_too_many_dimensions_and_long_names_are_refused(tmp_path: Path) -> None:
    array = struct.pack("<Iii", 0xF993FAC9, 0, 9) + struct.pack("<9q", *[1] * 9)
    source = tmp_path / "deep.params"
    source.write_bytes(struct.pack("<QQQ", 0x112, 0, 1) + array + struct.pack("<iii", 1, 0, 0))
    with pytest.raises(ValidationError, match="9 dimensions; trims stores at most 8"):
        convert(source, tmp_path / "out", name="m", version="1")
    one = struct.pack("<Iii", 0xF993FAC9, 0, 1) + struct.pack("<q", 1)
    one += struct.pack("<iii", 1, 0, 0) + struct.pack("<f", 1.0)
    name = b"n" * 513
    source.write_bytes(
        struct.pack("<QQQ", 0x112, 0, 1) + one + struct.pack("<QQ", 1, len(name)) + name
    )
    with pytest.raises(ValidationError, match="513 bytes, over the limit of 512"):
        convert(source, tmp_path / "out", name="m", version="1")
    assert not (tmp_path / "out").exists()
