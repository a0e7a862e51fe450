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
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, BinaryIO

from trims.errors import CorruptModel, PayloadTooLarge, ValidationError

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

# Note [full-string match]: every pattern here is applied with ``fullmatch``. ``re.match`` with
# a trailing ``$`` also accepts the string followed by one "\n" ("resnet\n"), which then becomes a
# second model, a file name or a log line with a newline in it.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")

# Note [manifest bounds]: an ``info`` or ``acquire`` reply carries the whole manifest in one
# frame of at most ``trims.protocol.MAX_FRAME`` (16 MiB). A manifest's compact JSON is bounded
# by MAX_MANIFEST_JSON (12 MiB), which leaves 4 MiB for the rest of the reply (model fields,
# a source of at most 4096 characters even when every one is escaped, pins, access lists, the
# handle); tests/trims/test_layout.py computes that worst case against MAX_FRAME. The count,
# name and shape bounds alone cannot guarantee the fit (65,536 names of 512 bytes, escaped,
# are ~100 MB); they refuse absurd input early, before any data is read or any JSON is built.
#: Most tensors in one model: the largest single-file checkpoints (mixture-of-experts models)
#: hold a few tens of thousands.
MAX_TENSORS = 65_536
#: Longest tensor name, in UTF-8 bytes. Real names (``model.layers.31.mlp.gate_proj.weight``,
#: ONNX's ``/encoder/layer.11/attention/...``) stay far below.
MAX_TENSOR_NAME = 512
#: Most dimensions of one tensor; weights have at most 5 or 6.
MAX_NDIM = 8
#: Largest layout and largest single dimension: 2**48 bytes (256 TiB), far past any model, and
#: small enough that offsets stay exact in every language's JSON numbers.
MAX_TOTAL_BYTES = 1 << 48
#: Largest manifest, as the compact JSON that crosses the socket (see Note [manifest bounds]).
MAX_MANIFEST_JSON = 12 << 20
#: Largest metadata object of a manifest, as compact JSON (informational strings only).
MAX_METADATA_JSON = 64 << 10
_MAX_FRAMEWORK = 64


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
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise ValidationError(
            f"invalid model name {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '..'"
        )
    return name


def validate_version(version: object) -> str:
    """A version is a path-safe token like a name, with ``+`` allowed (``1.2.0+cu121``)."""
    if not isinstance(version, str) or not _VERSION_RE.fullmatch(version) or ".." in version:
        raise ValidationError(
            f"invalid model version {version!r}: use 1-64 letters, digits, '.', '_', '+' or '-', "
            "starting with a letter or digit, without '..'"
        )
    return version


def validate_digest(digest: object) -> str:
    """A layout digest: the sha256 of the buffer as 64 lowercase hex characters."""
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise ValidationError(f"invalid digest {digest!r}: expected 64 lowercase hex characters")
    return digest


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_tensor_name(name: object) -> str:
    """A tensor name: 1 to MAX_TENSOR_NAME bytes of UTF-8 without control characters."""
    if not isinstance(name, str):
        raise ValidationError(f"tensor name {name!r} must be a string")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise ValidationError(f"tensor name {name!r} is not valid UTF-8 ({e.reason})") from e
    if size == 0:
        raise ValidationError("tensor name is empty; every tensor needs a name")
    if size > MAX_TENSOR_NAME:
        raise ValidationError(
            f"tensor name {name[:64]!r}... is {size} bytes of UTF-8, over the limit of "
            f"{MAX_TENSOR_NAME}; rename the tensor"
        )
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ValidationError(
            f"tensor name {name!r} contains control characters; rename the tensor"
        )
    return name


def validate_shape(name: str, shape: object) -> tuple[int, ...]:
    """A shape: at most MAX_NDIM dimensions, each an int in [0, MAX_TOTAL_BYTES]."""
    if not isinstance(shape, list | tuple) or not all(_is_int(d) for d in shape):
        raise ValidationError(f"tensor {name!r} has invalid shape {shape!r}: use a list of ints")
    if len(shape) > MAX_NDIM:
        raise ValidationError(
            f"tensor {name!r} has invalid shape: {len(shape)} dimensions, more than the "
            f"{MAX_NDIM} trims stores"
        )
    if not all(0 <= d <= MAX_TOTAL_BYTES for d in shape):
        raise ValidationError(
            f"tensor {name!r} has invalid shape {list(shape)}: every dimension must be "
            f"between 0 and {MAX_TOTAL_BYTES}"
        )
    return tuple(shape)


def check_tensor_count(count: int, what: str) -> None:
    """PayloadTooLarge when ``what`` (a file, a manifest) holds more than MAX_TENSORS tensors."""
    if count > MAX_TENSORS:
        raise PayloadTooLarge(
            f"{what} holds {count} tensors; trims stores at most {MAX_TENSORS} per model: "
            "merge small tensors or split the model",
            size=count,
            limit=MAX_TENSORS,
        )


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
        validate_tensor_name(name)
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise ValidationError(
                f"tensor {name!r} has unknown dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}"
            )
        dims = validate_shape(name, shape)
        for v, what in ((offset, "offset"), (nbytes, "nbytes")):
            if not _is_int(v) or not 0 <= v <= MAX_TOTAL_BYTES:
                raise ValidationError(
                    f"tensor {name!r} has invalid {what} {v!r}: use an int between 0 and "
                    f"{MAX_TOTAL_BYTES}"
                )
        entry = cls(name, dtype, dims, offset, nbytes)
        if entry.numel * DTYPE_SIZES[dtype] != nbytes:
            raise ValidationError(
                f"tensor {name!r}: nbytes {nbytes} does not match shape {list(dims)} x {dtype}"
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
        if not isinstance(raw_tensors, list):
            raise ValidationError("manifest 'tensors' must be a list of tensor entries")
        check_tensor_count(len(raw_tensors), "the manifest")
        if not _is_int(total) or not 0 <= total <= MAX_TOTAL_BYTES:
            raise ValidationError(
                f"manifest total_bytes {total!r} must be an int between 0 and {MAX_TOTAL_BYTES}"
            )
        metadata = d.get("metadata") or {}
        if not isinstance(metadata, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise ValidationError("manifest 'metadata' must be an object of strings")
        framework = d.get("framework", "unknown")
        if not isinstance(framework, str) or not 0 < len(framework) <= _MAX_FRAMEWORK:
            raise ValidationError(
                f"manifest framework {framework!r} must be a string of 1-{_MAX_FRAMEWORK} "
                "characters"
            )
        numbers = {}
        for key, default in (("alignment", ALIGNMENT), ("layout_version", LAYOUT_VERSION)):
            value = d.get(key, default)
            if not _is_int(value):
                raise ValidationError(f"manifest {key} {value!r} must be an int")
            numbers[key] = value
        m = cls(
            name=validate_model_name(d.get("name")),
            version=validate_version(d.get("version", "1")),
            digest=validate_digest(d.get("digest")),
            framework=framework,
            total_bytes=total,
            tensors=tuple(TensorEntry.from_dict(t) for t in raw_tensors),
            alignment=numbers["alignment"],
            layout_version=numbers["layout_version"],
            metadata=dict(metadata),
        )
        m.check_bounds()
        return m

    def check_bounds(self) -> None:
        """Raise if the manifest is too large to serve or any tensor is misaligned, outside
        the buffer or overlaps another (zero-byte tensors overlap nothing)."""
        if self.layout_version != LAYOUT_VERSION:
            raise ValidationError(
                f"manifest layout_version {self.layout_version} is not supported "
                f"(this trims reads version {LAYOUT_VERSION}); upgrade trims"
            )
        if (
            self.alignment < ALIGNMENT
            or self.alignment > PAGE
            or self.alignment & (self.alignment - 1)
        ):
            raise ValidationError(
                f"manifest of {self.name}: alignment {self.alignment} must be a power of two "
                f"between {ALIGNMENT} and {PAGE}"
            )
        check_tensor_count(len(self.tensors), f"the manifest of {self.name}")
        self._check_ranges()
        self._check_encoded_size()

    def _check_ranges(self) -> None:
        seen: set[str] = set()
        end, last = 0, ""
        for t in sorted(self.tensors, key=lambda t: (t.offset, t.nbytes)):
            if t.name in seen:
                raise ValidationError(f"manifest of {self.name}: duplicate tensor {t.name!r}")
            seen.add(t.name)
            if t.offset % self.alignment:
                raise ValidationError(
                    f"manifest of {self.name}: tensor {t.name!r} offset {t.offset} "
                    f"is not a multiple of {self.alignment}"
                )
            t_end = t.offset + t.nbytes
            if t_end > self.total_bytes:
                raise ValidationError(
                    f"manifest of {self.name}: tensor {t.name!r} ends at {t_end}, "
                    f"past the buffer ({self.total_bytes} bytes)"
                )
            if t.nbytes and t.offset < end:
                raise ValidationError(
                    f"manifest of {self.name}: tensor {t.name!r} (bytes {t.offset}-{t_end}) "
                    f"overlaps tensor {last!r}, which ends at byte {end}"
                )
            if t_end > end:
                end, last = t_end, t.name

    def _check_encoded_size(self) -> None:
        meta = len(json.dumps(dict(self.metadata), separators=(",", ":")))
        if meta > MAX_METADATA_JSON:
            raise PayloadTooLarge(
                f"manifest of {self.name}: metadata is {meta} bytes of JSON, over the limit of "
                f"{MAX_METADATA_JSON}; drop large metadata from the model file",
                size=meta,
                limit=MAX_METADATA_JSON,
            )
        size = len(json.dumps(self.to_dict(), separators=(",", ":")))
        if size > MAX_MANIFEST_JSON:
            raise PayloadTooLarge(
                f"manifest of {self.name} is {size} bytes of JSON ({len(self.tensors)} "
                f"tensors), over the limit of {MAX_MANIFEST_JSON} that lets it cross the socket "
                "in one reply; shorten the tensor names or merge small tensors",
                size=size,
                limit=MAX_MANIFEST_JSON,
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
        check_spec(s)
        if s.name in names:
            raise ValidationError(f"duplicate tensor name {s.name!r}")
        names.add(s.name)
        check_tensor_count(len(names), "the model")
        offset = align_up(offset)
        entries.append(TensorEntry(s.name, s.dtype, tuple(s.shape), offset, s.nbytes))
        offset += s.nbytes
        if offset > MAX_TOTAL_BYTES:
            raise PayloadTooLarge(
                f"the model's tensors need more than {MAX_TOTAL_BYTES} bytes (at tensor "
                f"{s.name!r}); trims stores layouts of at most that size",
                limit=MAX_TOTAL_BYTES,
            )
    return tuple(entries), align_up(max(offset, 1), PAGE)


def check_spec(spec: TensorSpec) -> None:
    """ValidationError unless ``spec`` has a valid name, a known dtype and a bounded shape."""
    validate_tensor_name(spec.name)
    if spec.dtype not in DTYPE_SIZES:
        raise ValidationError(f"tensor {spec.name!r}: unsupported dtype {spec.dtype!r}")
    validate_shape(spec.name, spec.shape)
    if spec.nbytes > MAX_TOTAL_BYTES:
        raise ValidationError(
            f"tensor {spec.name!r} of shape {list(spec.shape)} x {spec.dtype} needs "
            f"{spec.nbytes} bytes, more than the {MAX_TOTAL_BYTES} a layout may hold"
        )


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
