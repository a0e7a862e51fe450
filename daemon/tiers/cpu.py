"""CPU tier: each resident model is one sealed memfd holding its canonical layout.

Note [sealed memfd]
~~~~~~~~~~~~~~~~~~~
::

    disk blob ──copy_file_range (kernel side)──> memfd ──sha256──> seal(WRITE|GROW|SHRINK|SEAL)
                                                   │
                                 SCM_RIGHTS fd ────┴──> client mmap(MAP_PRIVATE)

Once sealed, nobody (the daemon included) can write, grow or shrink the memfd, and the seals
themselves cannot be removed. Clients map it ``MAP_PRIVATE``: reads share the page cache pages
of the memfd, a write gives the writer a private copy-on-write page. So no tenant can change
what another tenant reads. The content is verified against the manifest digest after the copy
and before the seal, so what is served is what was verified.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
from pathlib import Path

from trims.daemon.tiers.memory import Export, Progress
from trims.errors import CorruptModel, TrimsError

log = logging.getLogger(__name__)

SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
_CHUNK = 64 << 20


def _copy(src: int, dst: int, size: int, progress: Progress | None) -> int:
    """Copy ``size`` bytes kernel-side; return how many were copied (less at EOF)."""
    done = 0
    while done < size:
        try:
            n = os.copy_file_range(src, dst, min(_CHUNK, size - done), done, done)
        except OSError:
            os.lseek(dst, done, os.SEEK_SET)
            n = os.sendfile(dst, src, done, min(_CHUNK, size - done))
        if n == 0:
            break
        done += n
        if progress is not None:
            progress("load", done, size)
    return done


def _sha256_fd(fd: int, size: int, progress: Progress | None) -> str:
    h = hashlib.sha256()
    if size == 0:
        return h.hexdigest()
    with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as m, memoryview(m) as view:
        for start in range(0, size, _CHUNK):
            h.update(view[start : start + _CHUNK])
            if progress is not None:
                progress("verify", min(start + _CHUNK, size), size)
    return h.hexdigest()


def create_sealed_memfd(
    source: Path, size: int, digest: str, label: str, progress: Progress | None = None
) -> int:
    """A sealed memfd with the first ``size`` bytes of ``source``, verified against ``digest``.

    Blocking (the server runs it in a thread). Raises CorruptModel when the file is shorter
    than ``size`` or its content does not hash to ``digest``; the memfd is closed then.
    """
    try:
        fd = os.memfd_create(f"trims:{label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as e:
        raise TrimsError(f"cannot create a memfd for {label}: {e}") from e
    try:
        os.ftruncate(fd, size)
        try:
            src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError as e:
            raise CorruptModel(
                f"the disk copy of {label} is missing ({digest[:12]}); remove the model and "
                "add it again"
            ) from e
        try:
            copied = _copy(src, fd, size, progress)
        finally:
            os.close(src)
        if copied != size:
            raise CorruptModel(
                f"the disk copy of {label} is truncated: {copied} of {size} bytes; remove the "
                "model and add it again"
            )
        actual = _sha256_fd(fd, size, progress)
        if actual != digest:
            raise CorruptModel(
                f"the disk copy of {label} fails its digest check (expected {digest[:12]}, "
                f"got {actual[:12]}); remove the model and add it again"
            )
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


class CpuTier:
    """Sealed memfds by digest. The tier owns one fd per resident model."""

    name = "cpu"

    def __init__(self) -> None:
        self._fds: dict[str, tuple[int, int]] = {}

    def load(
        self, digest: str, source: Path, size: int, label: str, progress: Progress | None = None
    ) -> None:
        """Blocking: copy, verify and seal; then the model is resident."""
        if digest in self._fds:
            return
        fd = create_sealed_memfd(source, size, digest, label, progress)
        self._fds[digest] = (fd, size)
        log.info("model %s loaded into cpu tier (%d bytes, sealed memfd)", label, size)

    def export(self, digest: str) -> Export:
        fd, size = self._fds[digest]
        return Export({"kind": "memfd", "size": size}, fd)

    def free(self, digest: str) -> None:
        """Close our fd; client mappings stay valid (Note [lease keeps memory alive])."""
        fd, _ = self._fds.pop(digest)
        os.close(fd)

    def close(self) -> None:
        for digest in list(self._fds):
            self.free(digest)
