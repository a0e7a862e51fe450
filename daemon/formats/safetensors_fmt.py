"""safetensors -> canonical layout, parsed here (no safetensors import in the daemon).

File format: an 8-byte little-endian header length N, N bytes of JSON mapping each tensor name
to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the
header) plus an optional ``"__metadata__"`` object of strings, then the data. The input is
mmapped and each tensor is streamed into place.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from pathlib import Path
from typing import Any

from trims.daemon.formats.writer import LayoutWriter, chunked, mapped
from trims.errors import CorruptModel, PayloadTooLarge, ValidationError
from trims.layout import (
    DTYPE_SIZES,
    MAX_METADATA_JSON,
    MAX_NDIM,
    MAX_TENSORS,
    Manifest,
    TensorSpec,
    check_tensor_count,
)
from trims.protocol import Progress

log = logging.getLogger(__name__)

#: safetensors dtype code -> canonical dtype name.
DTYPES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "C64": "complex64",
}
#: Largest JSON header accepted: 32 MiB. A header describes the manifest trims serves, which is
#: at most MAX_MANIFEST_JSON (12 MiB, see Note [manifest bounds] in trims/layout.py); twice that
#: leaves room for whitespace and ``__metadata__``, and bounds the memory the parse takes
#: (the reference implementation allows 100 MB).
MAX_HEADER = 32 << 20


def _tensor_table(source: Path, header: dict[str, Any], data_len: int) -> list[tuple[str, Any]]:
    items = [(k, v) for k, v in header.items() if k != "__metadata__"]
    check_tensor_count(len(items), str(source))
    for key, info in items:
        if not isinstance(info, dict):
            raise CorruptModel(f"{source}: header entry {key!r} is not an object")
        try:
            code, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptModel(f"{source}: header entry {key!r} is malformed: {e}") from e
        if code not in DTYPES:
            raise ValidationError(
                f"{source}: tensor {key!r} has dtype {code!r}, which trims does not support; "
                f"convert it to one of {sorted(DTYPES)}"
            )
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_NDIM
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
        ):
            raise CorruptModel(
                f"{source}: tensor {key!r} has invalid shape {shape!r} (at most {MAX_NDIM} "
                "non-negative dimensions)"
            )
        if not all(isinstance(o, int) and not isinstance(o, bool) for o in (begin, end)):
            raise CorruptModel(f"{source}: tensor {key!r} has non-integer data offsets")
        nbytes = math.prod(shape) * DTYPE_SIZES[DTYPES[code]]
        if not 0 <= begin <= end or end - begin != nbytes:
            raise CorruptModel(
                f"{source}: tensor {key!r} data offsets [{begin}, {end}] do not match its "
                f"shape {shape} x {code} ({nbytes} bytes)"
            )
        if end > data_len:
            raise CorruptModel(
                f"{source}: tensor {key!r} ends at byte {end} of the data section, which has "
                f"only {data_len} bytes: the file is truncated"
            )
    items.sort(key=lambda kv: (kv[1]["data_offsets"][0], kv[0]))
    _refuse_overlaps(source, items)
    return items


def _refuse_overlaps(source: Path, items: list[tuple[str, Any]]) -> None:
    """CorruptModel naming two tensors whose bytes overlap; ``items`` sorted by start offset.

    A safetensors file stores each tensor's bytes once (the safetensors library refuses
    overlaps); a file that aliases them is corrupt or crafted, whatever bytes it would yield."""
    last: tuple[str, int, int] | None = None  # the tensor reaching furthest so far
    for key, info in items:
        begin, end = info["data_offsets"]
        if begin == end:
            continue
        if last is not None and begin < last[2]:
            raise CorruptModel(
                f"{source}: tensors {last[0]!r} (bytes [{last[1]}, {last[2]})) and {key!r} "
                f"(bytes [{begin}, {end})) overlap in the data section; a safetensors file "
                "stores each tensor's bytes once: save the model again (safetensors save_file)"
            )
        if last is None or end > last[2]:
            last = (key, begin, end)


def convert_safetensors(
    source: Path, dest: Path, *, name: str, version: str, progress: Progress | None
) -> Manifest:
    with open(source, "rb") as f:
        size = f.seek(0, 2)
        if size < 8:
            raise CorruptModel(f"{source}: {size} bytes is too short for a safetensors file")
        f.seek(0)
        (header_len,) = struct.unpack("<Q", f.read(8))
        if 8 + header_len > size:
            raise CorruptModel(
                f"{source}: header length {header_len} is invalid for a file of {size} bytes"
            )
        if header_len > MAX_HEADER:
            raise PayloadTooLarge(
                f"{source}: the safetensors header is {header_len} bytes, over the limit of "
                f"{MAX_HEADER}; trims reads headers of at most that size (at most "
                f"{MAX_TENSORS} tensors)",
                size=header_len,
                limit=MAX_HEADER,
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise CorruptModel(f"{source}: the JSON header cannot be parsed: {e!r}") from e
        if not isinstance(header, dict):
            raise CorruptModel(f"{source}: the JSON header is not an object")
        base = 8 + header_len
        items = _tensor_table(source, header, size - base)
        metadata = {"source_format": "safetensors"}
        if isinstance(header.get("__metadata__"), dict):
            text = json.dumps(header["__metadata__"], sort_keys=True)
            # As a string inside the manifest's metadata, escaped once more.
            encoded = len(json.dumps(text))
            if encoded <= MAX_METADATA_JSON // 2:
                metadata["safetensors_metadata"] = text
            else:
                log.warning(
                    "model file %s: __metadata__ of %d bytes not kept (limit %d bytes); "
                    "the tensors are converted without it",
                    source,
                    encoded,
                    MAX_METADATA_JSON // 2,
                )
        total = sum(int(v["data_offsets"][1]) - int(v["data_offsets"][0]) for _, v in items)
        with (
            mapped(f) as view,
            LayoutWriter(dest, source=source, progress=progress, total_hint=total) as writer,
        ):
            for key, info in items:
                begin, end = info["data_offsets"]
                spec = TensorSpec(key, DTYPES[info["dtype"]], tuple(info["shape"]))
                writer.add(spec, chunked(view[base + begin : base + end]))
            manifest: Manifest = writer.finish(
                name=name, version=version, framework="safetensors", metadata=metadata
            )
    return manifest
