"""Model file formats converted into the canonical layout (:mod:`trims.layout`).

One module per format, each with one ``convert_<format>(source, dest, *, name, version,
progress) -> Manifest`` built on :class:`~trims.daemon.formats.writer.LayoutWriter`. No
converter executes code from a model file, and none holds a model twice in memory: inputs are
mmapped and written tensor by tensor.
"""

from __future__ import annotations

import importlib
import logging
import struct
from collections.abc import Callable
from pathlib import Path

from trims.errors import ValidationError
from trims.layout import (
    FORMAT_SUFFIXES,
    MODEL_FORMATS,
    Manifest,
    format_from_suffix,
    validate_model_name,
    validate_version,
)
from trims.protocol import Progress

log = logging.getLogger(__name__)

FORMATS: tuple[str, ...] = MODEL_FORMATS
_MXNET_MAGIC = struct.pack("<Q", 0x112)
_ZIP_MAGIC = b"PK\x03\x04"

Converter = Callable[..., Manifest]


def detect_format(path: Path, *, filename: str | None = None) -> str:
    """The format of a model file, from its magic bytes first and its suffix second.

    ``filename`` supplies the suffix when ``path`` is a temp file (a download).
    """
    with open(path, "rb") as f:
        head = f.read(16)
    if head[:8] == _MXNET_MAGIC:
        return "mxnet"
    if len(head) > 8 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] > 1:
        return "safetensors"
    if head[:4] == _ZIP_MAGIC:
        return "torch"
    shown = filename or path.name
    fmt = format_from_suffix(shown)
    if fmt is None:
        suffixes = ", ".join(f"{suffix} ({name})" for suffix, name in FORMAT_SUFFIXES.items())
        raise ValidationError(
            f"cannot tell the format of {shown}: its first bytes match no format trims knows "
            f"by content and its suffix is none of {suffixes}; rename it, or give the format "
            f"with `trims models add --format FORMAT` (the add request's 'format'), FORMAT "
            f"one of {', '.join(FORMATS)}"
        )
    return fmt


def _converter(fmt: str) -> Converter:
    """The format's converter, imported on first use (torch and onnx are heavy)."""
    if fmt not in FORMATS:
        raise ValidationError(f"unknown model format {fmt!r}; use one of {', '.join(FORMATS)}")
    module = importlib.import_module(f"{__name__}.{fmt}_fmt")
    converter: Converter = getattr(module, f"convert_{fmt}")
    return converter


def convert(
    source: Path,
    dest: Path,
    *,
    name: str,
    version: str,
    fmt: str | None = None,
    progress: Progress | None = None,
) -> Manifest:
    """Convert ``source`` into a new layout file ``dest`` (fsynced); return its manifest.

    CorruptModel names the file and what is wrong for truncated or corrupt input;
    ValidationError for unsupported dtypes, unknown formats or a missing file. On any error
    ``dest`` does not exist afterwards.
    """
    validate_model_name(name)
    validate_version(version)
    if not source.is_file():
        raise ValidationError(f"model source {source} is not a regular file")
    fmt = fmt or detect_format(source)
    converter = _converter(fmt)
    manifest: Manifest = converter(source, dest, name=name, version=version, progress=progress)
    log.info(
        "model %s:%s converted from %s (%s): %d tensors, %d bytes, digest %s",
        name,
        version,
        source.name,
        fmt,
        len(manifest.tensors),
        manifest.total_bytes,
        manifest.digest[:12],
    )
    return manifest


__all__ = ["FORMATS", "Progress", "convert", "detect_format"]
