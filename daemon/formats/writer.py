"""Writes the canonical layout (see :mod:`trims.layout`) into a new file, tensor by tensor.

Converters hand the writer one tensor at a time as a stream of raw C-order byte chunks, usually
slices of an mmap of the source file, so a model is never held twice in memory. The writer puts
each tensor at the offset :func:`trims.layout.plan` assigns, fills the gaps with zeros, hashes
every byte it writes (padding included) and fsyncs the file before it returns the manifest.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from trims.errors import CorruptModel, ValidationError
from trims.layout import (
    PAGE,
    Manifest,
    TensorEntry,
    TensorSpec,
    align_up,
    check_spec,
    check_tensor_count,
    plan,
)
from trims.protocol import Progress

log = logging.getLogger(__name__)

#: Chunks larger than this are split before writing, so progress advances smoothly.
CHUNK = 8 << 20
_ZEROS = bytes(PAGE)


def chunked(buf: memoryview, chunk: int = CHUNK) -> Iterable[memoryview]:
    """Slices of ``buf`` (as bytes) of at most ``chunk`` bytes; nothing for an empty buffer."""
    flat = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
    for start in range(0, len(flat), chunk):
        yield flat[start : start + chunk]


@contextlib.contextmanager
def mapped(f: BinaryIO) -> Iterator[memoryview]:
    """A read-only memoryview of a whole open file through mmap (empty for an empty file)."""
    if os.fstat(f.fileno()).st_size == 0:
        yield memoryview(b"")
        return
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(mm)
    try:
        yield view
    finally:
        try:
            view.release()
            mm.close()
        except BufferError:
            # A slice is still referenced (by a traceback being raised): the mapping goes away
            # with the last reference instead of now.
            pass


class LayoutWriter:
    """Appends tensors to a new layout file; :meth:`finish` pads, fsyncs and builds the manifest.

    Use as a context manager: on an exception the partly written file is removed.
    """

    def __init__(
        self,
        dest: Path,
        *,
        source: Path,
        progress: Progress | None = None,
        total_hint: int | None = None,
    ) -> None:
        self._dest = dest
        self._source = source
        self._progress = progress
        self._total_hint = total_hint
        self._file: BinaryIO = open(dest, "xb")  # noqa: SIM115 - closed in finish/__exit__
        self._hash = hashlib.sha256()
        self._offset = 0
        self._specs: list[TensorSpec] = []
        self._entries: list[TensorEntry] = []
        self._done = 0

    def __enter__(self) -> LayoutWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._file.closed:
            self._file.close()
        if exc_type is not None:
            self._dest.unlink(missing_ok=True)

    @property
    def next_offset(self) -> int:
        """Where the next tensor will start."""
        return align_up(self._offset)

    def _write(self, data: bytes | memoryview) -> None:
        # Hash first: that faults the source's pages in (usually an mmap of the source file),
        # so the write copies from resident memory and the page cache gets large folios. Written
        # the other way round, the kernel's atomic copy meets unmapped source pages and retries
        # with ever smaller chunks: a 512 MiB layout then sat in ~5,000 folios instead of ~700,
        # and a client mapping it (Note [page-cache copies]) took 7x the faults.
        self._hash.update(data)
        self._file.write(data)
        self._offset += len(data)

    def _pad_to(self, offset: int) -> None:
        while self._offset < offset:
            self._write(_ZEROS[: min(PAGE, offset - self._offset)])

    def add(self, spec: TensorSpec, chunks: Iterable[bytes | memoryview]) -> TensorEntry:
        """Write one tensor's raw bytes; CorruptModel if the chunks are not exactly its size.

        The spec is checked against the layout's bounds (name, shape, tensor count) before a
        byte of it is written.
        """
        try:
            check_spec(spec)
        except ValidationError as e:
            raise ValidationError(f"{self._source}: {e.message}") from e
        check_tensor_count(len(self._specs) + 1, str(self._source))
        self._pad_to(self.next_offset)
        start = self._offset
        want = spec.nbytes
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            if self._offset - start + len(view) > want:
                raise CorruptModel(
                    f"{self._source}: tensor {spec.name!r} has more data than its shape "
                    f"{list(spec.shape)} x {spec.dtype} ({want} bytes) allows"
                )
            self._write(view)
            self._done += len(view)
            if self._progress is not None:
                self._progress("convert", self._done, self._total_hint)
        if self._offset - start != want:
            raise CorruptModel(
                f"{self._source}: tensor {spec.name!r} is truncated: {self._offset - start} of "
                f"{want} bytes present; the file is incomplete, fetch or export it again"
            )
        self._specs.append(spec)
        entry = TensorEntry(spec.name, spec.dtype, tuple(spec.shape), start, want)
        self._entries.append(entry)
        return entry

    def finish(
        self, *, name: str, version: str, framework: str, metadata: Mapping[str, str]
    ) -> Manifest:
        """Pad to a whole page, fsync, close; return the manifest of what was written."""
        entries, total = plan(self._specs)
        if entries != tuple(self._entries):
            raise ValidationError(f"{self._source}: tensor offsets disagree with the layout plan")
        self._pad_to(total)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        manifest = Manifest(
            name=name,
            version=version,
            digest=self._hash.hexdigest(),
            framework=framework,
            total_bytes=total,
            tensors=entries,
            metadata=dict(metadata),
        )
        manifest.check_bounds()
        log.debug(
            "model %s:%s converted from %s: %d tensors, %d bytes",
            name,
            version,
            self._source,
            len(entries),
            total,
        )
        return manifest
