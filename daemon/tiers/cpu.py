"""CPU tier: each resident model is one sealed memfd holding its canonical layout, or the
verified disk file kept in the page cache where that maps faster (:mod:`.pagecache`).

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

Note [huge pages]
~~~~~~~~~~~~~~~~~
The memfd is filled through a mapping advised ``MADV_HUGEPAGE``. Where the node allows shmem
transparent huge pages (``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` set to
``advise``, ``within_size`` or ``always``) the model then sits in 2 MiB pages, and a client
that reads every weight takes one page fault per 2 MiB instead of per 4 KiB: touching 1000 MiB
went from about 85 ms to 5 ms on our 2-core test machine. With ``never`` (the kernel default)
the advice is ignored and everything works with 4 KiB pages. The tier says at start which
applies (:func:`huge_page_mode`, one log line), and workers populate their mappings before the
first request either way (Note [populate before the first request] in
``trims/runtime/mapping.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import mmap
import os
from pathlib import Path

from trims.daemon.tiers.disk import Stamp, check_copy_digest, open_copy
from trims.daemon.tiers.memory import Export, Loaded, Progress
from trims.daemon.tiers.pagecache import PinnedFile
from trims.errors import CorruptModel, TrimsError

log = logging.getLogger(__name__)

SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
#: Bytes copied and hashed per step: small enough to hash while still in cache.
_CHUNK = 4 << 20
_THP = Path("/sys/kernel/mm/transparent_hugepage")
#: Modes in which a memfd advised MADV_HUGEPAGE gets huge pages (Note [huge pages]).
_HUGE_MODES = ("advise", "within_size", "always", "force")


def _selected(path: Path) -> str | None:
    """The bracketed choice in a sysfs setting ("always [never]" -> "never"), None if absent."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def _shmem_huge_sizes(root: Path) -> tuple[str | None, list[str]]:
    """(the top shmem_enabled mode or None if unreadable, page sizes a memfd advised
    MADV_HUGEPAGE may get, smallest first)."""
    top = _selected(root / "shmem_enabled")
    if top is None:
        return None, []
    sizes = []
    for entry in sorted(root.glob("hugepages-*kB"), key=lambda p: int(p.name[10:-2])):
        mode = _selected(entry / "shmem_enabled")
        if mode in _HUGE_MODES or (mode == "inherit" and top in _HUGE_MODES):
            sizes.append(entry.name[10:])
    return top, sizes


def shmem_huge_pages(root: Path = _THP) -> bool:
    """Whether a memfd advised MADV_HUGEPAGE gets huge pages here (Note [huge pages])."""
    return bool(_shmem_huge_sizes(root)[1])


def huge_page_mode(root: Path = _THP) -> str:
    """One sentence: which page size the CPU tier's memfds get here, and why (Note [huge pages])."""
    top, sizes = _shmem_huge_sizes(root)
    if top is None:
        return (
            f"{root}/shmem_enabled is not readable: models sit in 4 KiB pages (the memfd's "
            "MADV_HUGEPAGE advice has no effect)"
        )
    if sizes:
        return (
            f"shmem huge pages {top!r} ({root}/shmem_enabled), the memfd advised MADV_HUGEPAGE: "
            f"models sit in pages of up to {sizes[-1]} (sizes enabled: {', '.join(sizes)})"
        )
    return (
        f"shmem huge pages {top!r} ({root}/shmem_enabled): models sit in 4 KiB pages and the "
        "memfd's MADV_HUGEPAGE advice is ignored; workers populate their mappings before the "
        "first request, and 'echo advise > shmem_enabled' gives 2 MiB pages"
    )


def _fill_and_hash(src: int, dst: int, size: int, progress: Progress | None) -> tuple[int, str]:
    """Copy ``size`` bytes of ``src`` into the memfd ``dst``; (bytes copied, sha256 of them).

    Each chunk is hashed from the memfd right after it is written (Note [sealed memfd]).
    """
    h = hashlib.sha256()
    if size == 0:
        return 0, h.hexdigest()
    done = 0
    with mmap.mmap(dst, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
        with contextlib.suppress(OSError):
            m.madvise(mmap.MADV_HUGEPAGE)  # Note [huge pages]
        with memoryview(m) as view:
            while done < size:
                with view[done : min(done + _CHUNK, size)] as chunk:
                    n = os.preadv(src, [chunk], done)
                    h.update(chunk[:n])
                if n == 0:
                    break
                done += n
                if progress is not None:
                    progress("load", done, size)
                    progress("verify", done, size)
    return done, h.hexdigest()


def create_sealed_memfd(
    source: Path, size: int, digest: str, label: str, progress: Progress | None = None
) -> tuple[int, Stamp | None]:
    """A sealed memfd with the first ``size`` bytes of ``source``, verified against ``digest``,
    and the file's stamp when it did not change during the copy (else None).

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
            copied, actual = _fill_and_hash(src, fd, size, progress)
            stamp = before if Stamp.of(os.fstat(src)) == before else None
        finally:
            os.close(src)
        if copied != size:
            raise CorruptModel(
                f"the disk copy of {label} is truncated: {copied} of {size} bytes; remove the "
                "model and add it again"
            )
        check_copy_digest(actual, digest, label)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd, stamp


#: Values of ``--cpu-backing`` (Note [page-cache copies] in :mod:`trims.daemon.tiers.pagecache`).
CPU_BACKINGS = ("auto", "memfd", "file")


class CpuTier:
    """Resident models by digest: a sealed memfd each, or the verified disk file kept in the
    page cache (``backing``; Note [page-cache copies] in :mod:`trims.daemon.tiers.pagecache`)."""

    name = "cpu"

    def __init__(
        self, backing: str = "auto", thp: Path = _THP, daemon_is_root: bool | None = None
    ) -> None:
        if backing not in CPU_BACKINGS:
            raise ValueError(f"unknown cpu backing {backing!r}; use one of {CPU_BACKINGS}")
        if daemon_is_root is None:
            daemon_is_root = os.geteuid() == 0
        why = "--cpu-backing file"
        if backing == "auto":
            # A file copy is only as safe as its owner: root's blobs cannot be made writable by
            # function code (which never runs as root), a non-root daemon's can by any client
            # of its uid (Note [page-cache copies] in trims.daemon.tiers.pagecache).
            backing = "file" if daemon_is_root and not shmem_huge_pages(thp) else "memfd"
            why = (
                f"{thp}/shmem_enabled keeps shmem huge pages off; a memfd would sit in 4 KiB pages"
            )
        #: "memfd" or "file": how this tier holds every model it loads.
        self.backing = backing
        self._fds: dict[str, tuple[int, int]] = {}
        self._files: dict[str, PinnedFile] = {}
        if backing == "memfd":
            log.info("cpu tier: sealed memfds; %s", huge_page_mode(thp))
            return
        log.info(
            "cpu tier: verified disk files kept in the page cache and mapped read-only (large "
            "folios where the filesystem has them), not sealed memfds: %s",
            why,
        )
        if not daemon_is_root:
            log.warning(
                "cpu tier: --cpu-backing file with a daemon that is not root: a client running "
                "as the daemon's uid %d can make a blob writable and change what other clients "
                "map until their next acquire; use --cpu-backing memfd unless every client runs "
                "as another uid",
                os.geteuid(),
            )

    def load(
        self,
        digest: str,
        source: Path,
        size: int,
        label: str,
        progress: Progress | None = None,
        verified: Stamp | None = None,
    ) -> Loaded:
        """Blocking: verify (and copy, for a memfd); then the model is resident.

        A file copy skips the hash when the file still has the stamp ``verified``; a memfd
        copy always hashes (Note [trusted re-loads] in :mod:`trims.daemon.residency`).
        """
        pinned = self._files.get(digest)
        if pinned is not None:
            return Loaded(pinned.stamp, 0)
        if digest in self._fds:
            return Loaded(None, 0)
        if self.backing == "file":
            pinned = PinnedFile.open(source, size, digest, label, progress, verified)
            self._files[digest] = pinned
            log.info(
                "model %s loaded into cpu tier (%d bytes, page cache, %s, %s)",
                label,
                size,
                "locked" if pinned.locked else "mapped, not locked: reclaimable under pressure",
                "hashed" if pinned.hashed else "not hashed again: unchanged since verified",
            )
            return Loaded(pinned.stamp, pinned.hashed)
        fd, stamp = create_sealed_memfd(source, size, digest, label, progress)
        self._fds[digest] = (fd, size)
        log.info("model %s loaded into cpu tier (%d bytes, sealed memfd)", label, size)
        return Loaded(stamp, size)

    def current(self, digest: str) -> bool:
        """False when the copy is a disk file that changed since it was hashed: evict it."""
        pinned = self._files.get(digest)
        return pinned is None or pinned.unchanged()

    def holds_file(self, digest: str) -> bool:
        """Whether the copy is the disk blob itself (so the blob must stay on disk)."""
        return digest in self._files

    def export(self, digest: str) -> Export:
        pinned = self._files.get(digest)
        if pinned is not None:
            handle = {"kind": "file", "size": pinned.size, "populate": pinned.populate}
            return Export(handle, pinned.fd)
        fd, size = self._fds[digest]
        return Export({"kind": "memfd", "size": size}, fd)

    def free(self, digest: str) -> None:
        """Close our fd; client mappings stay valid (Note [lease keeps memory alive])."""
        pinned = self._files.pop(digest, None)
        if pinned is not None:
            pinned.close()
            return
        fd, _ = self._fds.pop(digest)
        os.close(fd)

    def close(self) -> None:
        for digest in [*self._fds, *self._files]:
            self.free(digest)
