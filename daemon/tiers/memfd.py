"""CPU tier copies as sealed memfds: filled from the disk blob, hashed, sealed.

Note [sealed memfd]
~~~~~~~~~~~~~~~~~~~
::

    disk blob ──read, chunk by chunk──> memfd (mapped shared, MADV_HUGEPAGE) ──sha256 of
                                        each chunk as written──> unmap ──> seal(WRITE|GROW|
                                                                              SHRINK|SEAL)
                                                   │
                                 SCM_RIGHTS fd ────┴──> client mmap(MAP_PRIVATE)

Once sealed, nobody (the daemon included) can write, grow or shrink the memfd, and the seals
themselves cannot be removed. Clients map it ``MAP_PRIVATE``: reads share the page cache pages
of the memfd, a write gives the writer a private copy-on-write page. So no tenant can change
what another tenant reads. The content is hashed from the memfd itself, chunk by chunk right
after each chunk is written (one pass over the data, the chunk still in cache), and compared
with the manifest digest before the seal, so what is served is what was verified.

A load checks the copy by its chunk digests on every core when they are known, else hashes
it whole and computes them beside (Note [chunk digests] in :mod:`trims.daemon.tiers.chunks`).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

from trims.daemon.tiers import chunks
from trims.daemon.tiers.chunks import ChunkDigests
from trims.daemon.tiers.disk import Stamp, check_copy_digest, open_copy
from trims.errors import CorruptModel, TrimsError
from trims.protocol import Progress

SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


def _read_chunk(src: int, chunk: memoryview, offset: int) -> int:
    """Fill ``chunk`` from ``src`` at ``offset``; the bytes read (fewer only at end of file)."""
    done = 0
    while done < len(chunk):
        with chunk[done:] as rest:
            n = os.preadv(src, [rest], offset + done)
        if n == 0:
            break
        done += n
    return done


class _Copy:
    """Copies ``size`` bytes of ``src`` into the memfd ``dst`` the first time its content is
    read, chunk by chunk, each chunk handed to the hash as soon as it is written (Note [sealed
    memfd]); later reads hash the memfd as it is."""

    def __init__(self, src: int, view: memoryview, size: int, progress: Progress | None) -> None:
        self.src, self.view, self.size, self.progress = src, view, size, progress
        self.copied: int | None = None

    def pieces(self) -> Iterator[memoryview]:
        if self.copied is not None:
            yield from chunks.view_pieces(self.view, self.copied)
            return
        self.copied = 0
        while self.copied < self.size:
            piece = self.view[self.copied : min(self.copied + chunks.CHUNK, self.size)]
            n = _read_chunk(self.src, piece, self.copied)
            self.copied += n
            if n < len(piece):
                piece.release()
                break
            if self.progress is not None:
                self.progress("load", self.copied, self.size)
            yield piece


def _fill_and_check(
    src: int, dst: int, size: int, digest: str, pool: ChunkDigests, progress: Progress | None
) -> tuple[int, chunks.Checked]:
    """Copy ``src`` into the memfd ``dst`` and check the copy against ``digest``: (bytes
    copied, what the check found). Always computes chunk digests on a first load, so that its
    re-loads can use them (Note [chunk digests])."""
    if size == 0:
        return 0, chunks.check(digest, 0, lambda: iter(()), pool)
    with mmap.mmap(dst, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
        with contextlib.suppress(OSError):
            m.madvise(mmap.MADV_HUGEPAGE)  # Note [huge pages] in trims.daemon.tiers.cpu
        with memoryview(m) as view:
            copy = _Copy(src, view, size, progress)
            checked = chunks.check(digest, size, copy.pieces, pool, each=True)
    if progress is not None:
        progress("verify", copy.copied or 0, size)
    return copy.copied or 0, checked


def create_sealed_memfd(
    source: Path,
    size: int,
    digest: str,
    label: str,
    pool: ChunkDigests,
    progress: Progress | None = None,
) -> tuple[int, Stamp | None]:
    """A sealed memfd with the first ``size`` bytes of ``source``, verified against ``digest``
    (or against its known chunk digests: Note [chunk digests]), and the file's stamp when it
    did not change during the copy (else None).

    Every byte is hashed, whatever the file's stamp (Note [trusted re-loads] in
    :mod:`trims.daemon.residency`). Blocking (the server runs it in a thread). Raises
    CorruptModel when the file is shorter than ``size`` or its content does not hash to
    ``digest``; the memfd is closed then.
    """
    try:
        fd = os.memfd_create(f"trims:{label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as e:
        raise TrimsError(f"cannot create a memfd for {label}: {e}") from e
    try:
        os.ftruncate(fd, size)
        src = open_copy(source, digest, label)
        try:
            before = Stamp.of(os.fstat(src))
            copied, checked = _fill_and_check(src, fd, size, digest, pool, progress)
            stamp = before if Stamp.of(os.fstat(src)) == before else None
        finally:
            os.close(src)
        if copied != size:
            raise CorruptModel(
                f"the disk copy of {label} is truncated: {copied} of {size} bytes; remove the "
                "model and add it again"
            )
        if checked.differ is not None:
            start, end = checked.differ
            raise CorruptModel(
                f"the disk copy of {label} fails its digest check (bytes {start} to {end} "
                "differ from the copy verified before); remove the model and add it again"
            )
        check_copy_digest(checked.actual, digest, label)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd, stamp
