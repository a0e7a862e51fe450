"""CPU tier: each resident model is one sealed memfd holding its canonical layout, or the
verified disk file kept in the page cache where that maps faster (:mod:`.pagecache`).

Sealed memfds are filled, hashed and sealed in :mod:`.memfd` (Note [sealed memfd], Note [chunk
digests]).

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

import logging
import os
from pathlib import Path

from trims.daemon.tiers.chunks import ChunkDigests
from trims.daemon.tiers.disk import Stamp
from trims.daemon.tiers.memfd import create_sealed_memfd
from trims.daemon.tiers.memory import Export, Loaded
from trims.daemon.tiers.pagecache import PinnedFile
from trims.protocol import Progress

log = logging.getLogger(__name__)

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


#: Values of ``--cpu-backing`` (Note [page-cache copies] in :mod:`trims.daemon.tiers.pagecache`).
CPU_BACKINGS = ("auto", "memfd", "file")


class CpuTier:
    """Resident models by digest: a sealed memfd each, or the verified disk file kept in the
    page cache (``backing``; Note [page-cache copies] in :mod:`trims.daemon.tiers.pagecache`)."""

    name = "cpu"

    def __init__(
        self,
        backing: str = "auto",
        thp: Path = _THP,
        daemon_is_root: bool | None = None,
        pool: ChunkDigests | None = None,
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
        #: Chunk digests of verified layouts, shared with the disk tier (Note [chunk digests]
        #: in trims.daemon.tiers.chunks); closed by whoever made it.
        self._own_pool = pool is None
        self.pool = ChunkDigests() if pool is None else pool
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
            pinned = PinnedFile.open(source, size, digest, label, progress, verified, self.pool)
            self._files[digest] = pinned
            log.info(
                "model %s loaded into cpu tier (%d bytes, page cache, %s, %s)",
                label,
                size,
                "locked" if pinned.locked else "mapped, not locked: reclaimable under pressure",
                "hashed" if pinned.hashed else "not hashed again: unchanged since verified",
            )
            return Loaded(pinned.stamp, pinned.hashed)
        fd, stamp = create_sealed_memfd(source, size, digest, label, self.pool, progress)
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
        if self._own_pool:
            self.pool.close()
