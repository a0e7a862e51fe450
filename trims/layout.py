"""The canonical layout: how a model version's tensors sit in one buffer.

Every tier (GPU, CPU memfd, disk file) holds exactly this layout, so promoting a model between
tiers is a copy or an mmap, never a re-parse::

    offset 0 (the buffer start is page aligned, 4096)
    ┌──────────────┬─pad─┬──────────────┬─pad─┬─── ... ───┬─pad to 4096─┐
    │ tensor 0     │     │ tensor 1     │     │           │             │
    └──────────────┴─────┴──────────────┴─────┴─── ... ───┴─────────────┘
      each tensor starts at a multiple of ALIGNMENT (64 bytes: a cache line, enough for
      AVX-512 loads and for every dtype's natural alignment); padding bytes are zero.

The :class:`Manifest` describes the buffer: model name and version, the sha256 of the whole
buffer (padding included), the framework it came from and the tensor table. Manifests cross
process boundaries as JSON (``to_dict`` / ``from_dict``) and are validated on the way in, so a
client never indexes outside the buffer it mapped.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, BinaryIO

from trims.errors import CorruptModel, ValidationError

ALIGNMENT = 64
PAGE = 4096
LAYOUT_VERSION = 1

#: dtype name -> item size in bytes. Names follow NumPy, plus bfloat16 (which NumPy lacks).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_TENSORS = 1_000_000
MAX_TENSOR_NAME = 1024
MAX_NDIM = 32


#: The model file formats a layout is made from (the store converts them; a function without a
#: daemon loads them directly), and the file suffix that names each.
MODEL_FORMATS: tuple[str, ...] = ("safetensors", "torch", "onnx", "mxnet")
FORMAT_SUFFIXES: dict[str, str] = {
    ".safetensors": "safetensors",
    ".pt": "torch",
    ".pth": "torch",
    ".bin": "torch",
    ".ckpt": "torch",
    ".onnx": "onnx",
    ".params": "mxnet",
}


def format_from_suffix(filename: str) -> str | None:
    """The model format a file name's suffix names (case-insensitive), or None."""
    return FORMAT_SUFFIXES.get(PurePath(filename).suffix.lower())


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    """The smallest multiple of ``alignment`` that is >= ``n``."""
    return (n + alignment - 1) // alignment * alignment


def validate_model_name(name: object) -> str:
    """A model name is a path-safe token: letters, digits, ``.``, ``_``, ``-``; no traversal."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name:
        raise ValidationError(
            f"invalid model name {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '..'"
        )
    return name


def validate_version(version: object) -> str:
    if not isinstance(version, str) or not _VERSION_RE.match(version) or ".." in version:
        raise ValidationError(
            f"invalid model version {version!r}: use 1-64 letters, digits, '.', '_', '+' or '-'"
        )
    return version


def validate_digest(digest: object) -> str:
    if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
        raise ValidationError(f"invalid digest {digest!r}: expected 64 lowercase hex characters")
    return digest


@dataclass(frozen=True)
class TensorEntry:
    """One tensor in the buffer: ``nbytes`` bytes at ``offset``, C-contiguous."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TensorEntry:
        try:
            name, dtype, shape = d["name"], d["dtype"], d["shape"]
            offset, nbytes = d["offset"], d["nbytes"]
        except (KeyError, TypeError) as e:
            raise ValidationError(f"tensor entry {d!r} lacks field {e}") from e
        if not isinstance(name, str) or not 0 < len(name) <= MAX_TENSOR_NAME:
            raise ValidationError(f"tensor name {name!r} must be a string of 1-1024 characters")
        if dtype not in DTYPE_SIZES:
            raise ValidationError(
                f"tensor {name!r} has unknown dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}"
            )
        if (
            not isinstance(shape, list | tuple)
            or len(shape) > MAX_NDIM
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
        ):
            raise ValidationError(f"tensor {name!r} has invalid shape {shape!r}")
        for v, what in ((offset, "offset"), (nbytes, "nbytes")):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValidationError(f"tensor {name!r} has invalid {what} {v!r}")
        entry = cls(name, dtype, tuple(shape), offset, nbytes)
        if entry.numel * DTYPE_SIZES[dtype] != nbytes:
            raise ValidationError(
                f"tensor {name!r}: nbytes {nbytes} does not match shape {list(shape)} x {dtype}"
            )
        return entry


@dataclass(frozen=True)
class Manifest:
    """The description of one model version's buffer. Crosses processes as JSON."""

    name: str
    version: str
    digest: str
    framework: str
    total_bytes: int
    tensors: tuple[TensorEntry, ...]
    alignment: int = ALIGNMENT
    layout_version: int = LAYOUT_VERSION
    metadata: Mapping[str, str] = field(default_factory=dict)

    def tensor(self, name: str) -> TensorEntry:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "digest": self.digest,
            "framework": self.framework,
            "total_bytes": self.total_bytes,
            "alignment": self.alignment,
            "layout_version": self.layout_version,
            "metadata": dict(self.metadata),
            "tensors": [t.to_dict() for t in self.tensors],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Manifest:
        """Parse and validate: every tensor aligned, inside the buffer, none overlapping."""
        if not isinstance(d, Mapping):
            raise ValidationError(f"manifest must be a JSON object, got {type(d).__name__}")
        try:
            raw_tensors = d["tensors"]
            total = d["total_bytes"]
        except KeyError as e:
            raise ValidationError(f"manifest lacks field {e}") from e
        if not isinstance(raw_tensors, list) or len(raw_tensors) > MAX_TENSORS:
            raise ValidationError("manifest 'tensors' must be a list of at most 1e6 entries")
        if not isinstance(total, int) or total < 0:
            raise ValidationError(f"manifest total_bytes {total!r} must be a non-negative int")
        metadata = d.get("metadata") or {}
        if not isinstance(metadata, Mapping):
            raise ValidationError("manifest 'metadata' must be an object of strings")
        m = cls(
            name=validate_model_name(d.get("name")),
            version=validate_version(d.get("version", "1")),
            digest=validate_digest(d.get("digest")),
            framework=str(d.get("framework", "unknown")),
            total_bytes=total,
            tensors=tuple(TensorEntry.from_dict(t) for t in raw_tensors),
            alignment=int(d.get("alignment", ALIGNMENT)),
            layout_version=int(d.get("layout_version", LAYOUT_VERSION)),
            metadata={str(k): str(v) for k, v in metadata.items()},
        )
        m.check_bounds()
        return m

    def check_bounds(self) -> None:
        """Raise if any tensor is misaligned, outside the buffer or overlaps another."""
        if self.layout_version != LAYOUT_VERSION:
            raise ValidationError(
                f"manifest layout_version {self.layout_version} is not supported "
                f"(this trims reads version {LAYOUT_VERSION}); upgrade trims"
            )
        seen: set[str] = set()
        end = 0
        for t in sorted(self.tensors, key=lambda t: t.offset):
            if t.name in seen:
                raise ValidationError(f"manifest of {self.name}: duplicate tensor {t.name!r}")
            seen.add(t.name)
            if t.offset % self.alignment:
                raise ValidationError(
                    f"manifest of {self.name}: tensor {t.name!r} offset {t.offset} "
                    f"is not a multiple of {self.alignment}"
                )
            if t.offset < end:
                raise ValidationError(f"manifest of {self.name}: tensor {t.name!r} overlaps")
            end = t.offset + t.nbytes
            if end > self.total_bytes:
                raise ValidationError(
                    f"manifest of {self.name}: tensor {t.name!r} ends at {end}, "
                    f"past the buffer ({self.total_bytes} bytes)"
                )


@dataclass(frozen=True)
class TensorSpec:
    """What a converter knows before writing: a tensor's name, dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def plan(specs: Iterable[TensorSpec]) -> tuple[tuple[TensorEntry, ...], int]:
    """Assign aligned offsets in the given order; return the entries and the buffer size.

    The buffer size is rounded up to a whole page so every tier can map it directly.
    """
    entries: list[TensorEntry] = []
    offset = 0
    names: set[str] = set()
    for s in specs:
        if s.dtype not in DTYPE_SIZES:
            raise ValidationError(f"tensor {s.name!r}: unsupported dtype {s.dtype!r}")
        if s.name in names:
            raise ValidationError(f"duplicate tensor name {s.name!r}")
        names.add(s.name)
        offset = align_up(offset)
        entries.append(TensorEntry(s.name, s.dtype, tuple(s.shape), offset, s.nbytes))
        offset += s.nbytes
    return tuple(entries), align_up(max(offset, 1), PAGE)


def sha256_stream(f: BinaryIO, total: int, chunk: int = 8 << 20) -> str:
    """sha256 of the first ``total`` bytes of ``f`` (from its current position)."""
    h = hashlib.sha256()
    left = total
    while left:
        b = f.read(min(chunk, left))
        if not b:
            raise CorruptModel(f"file is truncated: {left} of {total} bytes missing")
        h.update(b)
        left -= len(b)
    return h.hexdigest()


def sha256_buffer(buf: Any) -> str:
    """sha256 of a bytes-like object (memoryview, mmap, bytes) without copying it."""
    return hashlib.sha256(memoryview(buf).cast("B")).hexdigest()
