"""PyTorch state dicts (``.pt``/``.pth``) -> canonical layout.

The file is opened with ``torch.load(weights_only=True)`` (the restricted unpickler: no code
runs) and, for the zip format every torch since 1.6 writes, ``mmap=True``, so tensors are views
of the file and only one tensor at a time is materialized. Nested dicts (a checkpoint holding
``{"model": state_dict, "epoch": 3}``) are flattened with dotted names; lists and tuples use the
index as the name part. Entries that are not tensors (epochs, learning rates, strings) are
skipped with a log line.
"""

from __future__ import annotations

import logging
import pickle
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trims.daemon.formats.writer import LayoutWriter, chunked
from trims.errors import CorruptModel, PayloadTooLarge, ValidationError
from trims.layout import Manifest, TensorSpec, check_tensor_count
from trims.protocol import Progress

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: torch dtype name (``str(dtype)`` without the ``torch.`` prefix) -> canonical dtype name.
DTYPES: dict[str, str] = {
    "float64": "float64",
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "int64": "int64",
    "int32": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint64": "uint64",
    "uint32": "uint32",
    "uint16": "uint16",
    "uint8": "uint8",
    "bool": "bool",
    "complex64": "complex64",
    "complex128": "complex128",
}


#: Largest pickle (``data.pkl``) of a zip-format checkpoint: 64 MiB. It holds only the names,
#: shapes and storage keys (the data sits in separate zip entries), about 200 bytes per tensor,
#: so MAX_TENSORS tensors need a few MiB; the unpickler holds all of it in memory.
MAX_PICKLE = 64 << 20


def _check_archive(source: Path) -> None:
    """Refuse, before unpickling, a zip checkpoint whose pickle or storage count is too big."""
    try:
        with zipfile.ZipFile(source) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError) as e:
        raise CorruptModel(f"{source} is not a readable PyTorch file: {e}") from e
    pickles = [i for i in infos if i.filename.endswith("data.pkl")]
    for info in pickles:
        if info.file_size > MAX_PICKLE:
            raise PayloadTooLarge(
                f"{source}: its pickle {info.filename} is {info.file_size} bytes, over the "
                f"limit of {MAX_PICKLE}; save a plain state dict (`model.state_dict()`)",
                size=info.file_size,
                limit=MAX_PICKLE,
            )
    storages = sum(1 for i in infos if "/data/" in i.filename)
    check_tensor_count(storages, f"{source} (counting its storages)")


#: First byte of a pickle of protocol 2 or later (the PROTO opcode): torch.save's legacy,
#: non-zip format starts with one.
_PICKLE_PROTO = 0x80


def _check_container(source: Path) -> bool:
    """True for a zip checkpoint (torch.save's format), False for a legacy pickle; anything
    else is refused here, before torch blames its content (CorruptModel, saying what it is)."""
    if zipfile.is_zipfile(source):
        return True
    with open(source, "rb") as f:
        head = f.read(2)
    if len(head) == 2 and head[0] == _PICKLE_PROTO and 2 <= head[1] <= 5:
        return False
    shown = head.hex(" ") if head else "nothing: the file is empty"
    raise CorruptModel(
        f"{source} is not a PyTorch file: torch.save writes a zip archive (or, long ago, a "
        f"pickle), and it starts with {shown}; check that the file was saved with torch.save "
        "and copied whole, or give its real format with --format"
    )


def _load(source: Path) -> Any:
    import torch

    use_mmap = _check_container(source)
    if use_mmap:
        _check_archive(source)
    try:
        return torch.load(source, map_location="cpu", weights_only=True, mmap=use_mmap)
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) or "Weights only load failed" in str(e):
            raise ValidationError(
                f"{source} holds objects other than tensors and plain containers, which trims "
                "never unpickles; save `model.state_dict()` instead of the module"
            ) from e
        raise CorruptModel(f"{source} is not a readable PyTorch file: {e}") from e
    except Exception as e:  # the unpickler raises anything from IndexError to RuntimeError
        raise CorruptModel(
            f"{source} is not a readable PyTorch file (truncated or corrupt?): {e}"
        ) from e


def _flatten(source: Path, obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    import torch

    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _flatten(source, value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from _flatten(source, value, f"{prefix}.{i}" if prefix else str(i))
    else:
        log.info(
            "model file %s: entry %r is a %s, not a tensor; skipped (only tensors are stored)",
            source,
            prefix,
            type(obj).__name__,
        )


def _spec(source: Path, name: str, tensor: torch.Tensor) -> TensorSpec:
    import torch

    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ValidationError(
            f"{source}: tensor {name!r} has dtype {dtype}, which trims does not support; "
            f"convert it to one of {sorted(DTYPES)}"
        )
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise ValidationError(
            f"{source}: tensor {name!r} is sparse or quantized; store it dense (`.to_dense()`)"
        )
    return TensorSpec(name, DTYPES[dtype], tuple(tensor.shape))


def _raw(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order: a view of the mmap when it is already contiguous."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    view: memoryview = flat.numpy().data
    return view


def convert_torch(
    source: Path, dest: Path, *, name: str, version: str, progress: Progress | None
) -> Manifest:
    state = _load(source)
    tensors = list(_flatten(source, state, ""))
    check_tensor_count(len(tensors), str(source))
    if not tensors:
        raise ValidationError(
            f"{source} contains no tensors; trims stores state dicts (`torch.save(model."
            "state_dict(), path)`)"
        )
    specs = [_spec(source, key, t) for key, t in tensors]
    total = sum(s.nbytes for s in specs)
    with LayoutWriter(dest, source=source, progress=progress, total_hint=total) as writer:
        for spec, (_, tensor) in zip(specs, tensors, strict=True):
            writer.add(spec, chunked(_raw(tensor)))
        manifest: Manifest = writer.finish(
            name=name, version=version, framework="torch", metadata={"source_format": "torch"}
        )
    return manifest
