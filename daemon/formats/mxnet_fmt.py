"""MXNet ``.params`` (the NDArray list format of ``mx.nd.save``) -> canonical layout.

Parsed here in pure Python; the daemon never imports mxnet. All integers little-endian::

    u64 magic 0x112 | u64 reserved | u64 count | count x NDArray | u64 nnames | nnames x name
    NDArray: u32 magic (0xF993FAC9 = V2, 0xF993FACA = V3 with NumPy shape semantics)
             i32 storage type (0 dense; sparse types are refused)
             i32 ndim | ndim x i64 dims      (V2: ndim 0 = no array; V3: ndim -1 = no array)
             i32 dev_type | i32 dev_id | i32 type flag | the data, C order
    name:    u64 length | bytes (UTF-8)

Names are kept as saved (``arg:conv0_weight``, ``aux:bn0_moving_mean``, or Gluon's plain
names); a list saved without names gets its indices ("0", "1", ...). Empty (``None``) arrays are
skipped with a log line.
"""

from __future__ import annotations

import logging
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from trims.daemon.formats.writer import LayoutWriter, chunked, mapped
from trims.errors import CorruptModel, ValidationError
from trims.layout import (
    DTYPE_SIZES,
    MAX_NDIM,
    MAX_TENSOR_NAME,
    Manifest,
    TensorSpec,
    check_tensor_count,
)
from trims.protocol import Progress

log = logging.getLogger(__name__)

LIST_MAGIC = 0x112
V2_MAGIC = 0xF993FAC9
V3_MAGIC = 0xF993FACA
#: mshadow type flag -> canonical dtype name.
DTYPES: dict[int, str] = {
    0: "float32",
    1: "float64",
    2: "float16",
    3: "uint8",
    4: "int32",
    5: "int8",
    6: "int64",
    7: "bool",
    8: "int16",
    9: "uint16",
    10: "uint32",
    11: "uint64",
    12: "bfloat16",
}
_STORAGE = {1: "row_sparse", 2: "csr"}


@dataclass(frozen=True)
class _Array:
    dtype: str
    shape: tuple[int, ...]
    offset: int


class _Reader:
    """Bounds-checked little-endian reads from the mapped file."""

    def __init__(self, source: Path, view: memoryview) -> None:
        self.source, self.view, self.pos = source, view, 0

    def take(self, fmt: str, what: str) -> tuple[int, ...]:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.view):
            raise CorruptModel(
                f"{self.source} is truncated: {what} at byte {self.pos} runs past the end "
                f"({len(self.view)} bytes)"
            )
        values = struct.unpack_from(fmt, self.view, self.pos)
        self.pos += size
        return values

    def skip(self, n: int, what: str) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.view):
            raise CorruptModel(
                f"{self.source} is truncated: {what} needs {n} bytes at byte {start}, the file "
                f"has {len(self.view)}"
            )
        self.pos += n
        return start


def _read_array(r: _Reader, index: int) -> _Array | None:
    what = f"array {index}"
    (magic,) = r.take("<I", what)
    if magic not in (V2_MAGIC, V3_MAGIC):
        raise ValidationError(
            f"{r.source}: {what} uses the legacy NDArray format (magic {magic:#x}); load it with "
            "MXNet 1.x and save it again"
        )
    (stype,) = r.take("<i", what)
    if stype != 0:
        raise ValidationError(
            f"{r.source}: {what} has {_STORAGE.get(stype, f'storage type {stype}')} storage; "
            "trims stores dense arrays (`.tostype('default')` before saving)"
        )
    (ndim,) = r.take("<i", what)
    if (magic == V2_MAGIC and ndim == 0) or (magic == V3_MAGIC and ndim == -1):
        return None
    if ndim < 0:
        raise CorruptModel(f"{r.source}: {what} has {ndim} dimensions")
    if ndim > MAX_NDIM:
        raise ValidationError(
            f"{r.source}: {what} has {ndim} dimensions; trims stores at most {MAX_NDIM}"
        )
    shape = r.take(f"<{ndim}q", what)
    if any(d < 0 for d in shape):
        raise CorruptModel(f"{r.source}: {what} has an unknown dimension in shape {list(shape)}")
    _dev_type, _dev_id, flag = r.take("<iii", what)
    if flag not in DTYPES:
        raise ValidationError(f"{r.source}: {what} has unsupported MXNet type flag {flag}")
    dtype = DTYPES[flag]
    offset = r.skip(math.prod(shape) * DTYPE_SIZES[dtype], f"the data of {what}")
    return _Array(dtype, tuple(shape), offset)


def _parse(source: Path, view: memoryview) -> list[tuple[str, _Array]]:
    r = _Reader(source, view)
    magic, _reserved, count = r.take("<QQQ", "the header")
    if magic != LIST_MAGIC:
        raise CorruptModel(f"{source} is not an MXNet .params file (magic {magic:#x})")
    if count > len(view) // 12:
        raise CorruptModel(f"{source} announces {count} arrays, more than its size allows")
    check_tensor_count(count, str(source))
    arrays = [_read_array(r, i) for i in range(count)]
    (nnames,) = r.take("<Q", "the name count")
    if nnames not in (0, count):
        raise CorruptModel(f"{source} has {count} arrays but {nnames} names")
    names: list[str] = []
    for i in range(nnames):
        (length,) = r.take("<Q", f"name {i}")
        if length > MAX_TENSOR_NAME:
            raise ValidationError(
                f"{source}: name {i} is {length} bytes, over the limit of {MAX_TENSOR_NAME} "
                "bytes for a tensor name; rename the array"
            )
        start = r.skip(length, f"name {i}")
        try:
            names.append(bytes(view[start : start + length]).decode("utf-8"))
        except UnicodeDecodeError as e:
            raise CorruptModel(f"{source}: name {i} is not UTF-8") from e
    if r.pos != len(view):
        raise CorruptModel(f"{source} has {len(view) - r.pos} unexpected bytes after the names")
    out: list[tuple[str, _Array]] = []
    for i, array in enumerate(arrays):
        name = names[i] if names else str(i)
        if array is None:
            log.info("model file %s: array %r is empty (None); skipped", source, name)
            continue
        out.append((name, array))
    return out


def convert_mxnet(
    source: Path, dest: Path, *, name: str, version: str, progress: Progress | None
) -> Manifest:
    with open(source, "rb") as f, mapped(f) as view:
        arrays = _parse(source, view)
        if not arrays:
            raise ValidationError(f"{source} contains no arrays")
        specs = [TensorSpec(key, a.dtype, a.shape) for key, a in arrays]
        total = sum(s.nbytes for s in specs)
        with LayoutWriter(dest, source=source, progress=progress, total_hint=total) as writer:
            for spec, (_, array) in zip(specs, arrays, strict=True):
                writer.add(spec, chunked(view[array.offset : array.offset + spec.nbytes]))
            manifest: Manifest = writer.finish(
                name=name, version=version, framework="mxnet", metadata={"source_format": "mxnet"}
            )
    return manifest
