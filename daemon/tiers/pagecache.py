"""CPU tier copies kept as the verified disk file's own page cache.

Note [page-cache copies]
~~~~~~~~~~~~~~~~~~~~~~~~
Where shmem transparent huge pages are off (``shmem_enabled`` = ``never``, the kernel default),
a sealed memfd sits in 4 KiB pages and a client's first full read of 512 MiB takes about 8,200
page faults and 60 ms on our 2-core test machine. A file read through the page cache by
``read`` sits in large folios (readahead allocates them on filesystems that support them:
ext4 from Linux 6.16, xfs, btrfs), and a client mapping it takes about 800 faults and 5 ms for
the same 512 MiB. So there the CPU tier serves the disk-tier blob itself::

    disk blob ──open O_RDONLY──> fd ──pread, sha256 of every byte──> digest checked
                                  │      (fills the page cache in large folios)
                                  ├── daemon mmap(MAP_SHARED, PROT_READ) + mlock (or populate)
                                  └── SCM_RIGHTS fd ──> client mmap(MAP_PRIVATE)

Isolation, against the sealed memfd:
- a client's fd is read-only: ``mmap(MAP_SHARED, PROT_WRITE)`` and ``write`` fail, and its
  ``MAP_PRIVATE`` writes stay private copy-on-write pages, as with a memfd;
- the blob is mode 0400, owned by the daemon's uid: only that uid or root can make it writable
  (``fchmod``). A memfd's seals would still hold against them; the file does not (see below
  for when ``auto`` picks it). So every hand-out compares
  the fd's :class:`~trims.daemon.tiers.disk.Stamp` with the one taken when its every byte was
  hashed (any write, truncate or chmod moves ``ctime``, which userspace cannot set back): a
  changed file is evicted and loaded (hashed) again, as the disk tier does (Note [disk
  re-verification]); mappings handed out before see the change, as with the disk tier.

Note [who populates]: a worker populates its mapping in a background thread (Note [populate
before the first request] in trims/runtime/mapping.py). For a 4 KiB-page memfd that moves
8,200 faults and ~60 ms off the first request. For a file in large folios there is little to
move (~800 faults, 2-5 ms), and the populate thread, running while the worker imports its
handler, slowed that import from about 2 to 8-11 ms (two cores; the faults and the import
contend), so the instance started later than its first request would have gained. The daemon
counts the faults its own mapping took (about one per folio) and hands clients
``"populate": false`` when they average at least :data:`SPARSE_FAULT_BYTES` per fault; a file
in small folios (a filesystem without large folios, a page cache filled by small writes) keeps
``true``.

Staying resident: the daemon keeps the whole file mapped. ``mlock`` pins its pages (root, or a
``RLIMIT_MEMLOCK`` that allows the model's size); otherwise ``MADV_POPULATE_READ`` maps them,
which keeps ``drop_caches`` from dropping them (it skips mapped pages) but lets memory pressure
reclaim them, after which a client's reads go to disk again: correct, only slower. The tier's
log line says which applies.

``--cpu-backing`` chooses: ``memfd`` (always a sealed copy), ``file`` (always this), ``auto``
(the default): this only where shmem huge pages are off *and* the daemon runs as root. A root
daemon's blobs are root's, and function code never runs as root; a non-root daemon's blobs could
be made writable by any client of its uid (the Helm chart runs the daemon and function pods as
one uid; ``trims up`` by a user runs its workers as that user), which a sealed memfd forbids.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import resource
from pathlib import Path

from trims.daemon.tiers.chunks import ChunkDigests
from trims.daemon.tiers.disk import Stamp, check_copy_digest, check_file, open_copy
from trims.errors import CorruptModel, TrimsError
from trims.libc import MADV_POPULATE_READ, MAP_FAILED, libc
from trims.protocol import Progress

log = logging.getLogger(__name__)

#: ``RUSAGE_THREAD`` (Linux): the load runs in a thread of its own, so its faults are its own.
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", 1)


#: Bytes per page fault, on average, from which a client's first reads are cheap enough that a
#: background populate is not worth its cost (Note [who populates]).
SPARSE_FAULT_BYTES = 512 << 10


def needs_populate(size: int, faults: int) -> bool:
    """Whether clients should populate their mapping of a file that took the daemon ``faults``
    page faults to map whole (Note [who populates])."""
    return faults > max(1, size // SPARSE_FAULT_BYTES)


class PinnedFile:
    """One verified disk blob held open and mapped by the daemon (Note [page-cache copies])."""

    def __init__(
        self,
        fd: int,
        size: int,
        stamp: Stamp,
        address: int,
        locked: bool,
        faults: int,
        hashed: int,
    ) -> None:
        self.fd, self.size, self.stamp = fd, size, stamp
        #: Bytes hashed when it was opened: ``size``, or 0 when its stamp was trusted.
        self.hashed = hashed
        self._address: int | None = address
        #: True when ``mlock`` pins the pages; False when they are only mapped (populated).
        self.locked = locked
        #: Page faults the daemon's own mapping took to map the whole file (Note [who
        #: populates]); about one per folio.
        self.faults = faults

    @property
    def populate(self) -> bool:
        """The hint handed to clients: populate your mapping in the background."""
        return needs_populate(self.size, self.faults)

    @classmethod
    def open(
        cls,
        source: Path,
        size: int,
        digest: str,
        label: str,
        progress: Progress | None = None,
        verified: Stamp | None = None,
        pool: ChunkDigests | None = None,
    ) -> PinnedFile:
        """Open ``source``, hash its first ``size`` bytes against ``digest`` and map them.

        The hash is skipped when the file still has the stamp ``verified`` it was last hashed
        under (Note [trusted re-loads] in :mod:`trims.daemon.residency`); :attr:`hashed` says
        which happened; a hash checks chunk digests on ``pool`` when it knows them (Note
        [chunk digests] in :mod:`trims.daemon.tiers.chunks`). Blocking. Raises CorruptModel
        when the file is missing, shorter than ``size``, fails the digest, is writable by
        group or others, or changed while it was hashed.
        """
        fd = open_copy(source, digest, label)
        try:
            st = os.fstat(fd)
            before = Stamp.of(st)
            if st.st_mode & 0o022:
                raise CorruptModel(
                    f"the disk copy of {label} is writable by group or others (mode "
                    f"{st.st_mode & 0o777:o}); remove the model and add it again"
                )
            if before.size < size:
                raise CorruptModel(
                    f"the disk copy of {label} is truncated: {before.size} of {size} bytes; "
                    "remove the model and add it again"
                )
            hashed = 0 if before == verified else size
            if hashed:
                checked = check_file(fd, size, digest, pool, _loaded_and_verified(progress))
                check_copy_digest(checked.actual, digest, label)
                if Stamp.of(os.fstat(fd)) != before:
                    raise CorruptModel(
                        f"the disk copy of {label} changed while it was verified; remove the "
                        "model and add it again"
                    )
            before_faults = resource.getrusage(_RUSAGE_THREAD).ru_minflt
            address, locked = _map_resident(fd, size, label)
            faults = resource.getrusage(_RUSAGE_THREAD).ru_minflt - before_faults
        except BaseException:
            os.close(fd)
            raise
        if not hashed and progress is not None:
            progress("load", size, size)
        pinned = cls(fd, size, before, address, locked, faults, hashed)
        log.debug("model %s: mapped in %d faults (clients populate: %s)",
                  label, faults, pinned.populate)  # fmt: skip
        return pinned

    def unchanged(self) -> bool:
        """Whether the file is still exactly what was hashed (its stamp has not moved)."""
        return bool(Stamp.of(os.fstat(self.fd)) == self.stamp)

    def close(self) -> None:
        """Unmap and close; client mappings stay valid (the kernel keeps their pages)."""
        address, self._address = self._address, None
        if address is None:
            return
        if self.size:
            libc().munmap(address, self.size)
        os.close(self.fd)


def _loaded_and_verified(progress: Progress | None) -> Progress | None:
    """Report each hashed chunk as both loaded and verified, as a memfd copy does: reading it
    is what brings it into memory."""
    if progress is None:
        return None

    def report(stage: str, done: int, total: int | None) -> None:
        progress("load", done, total)
        progress("verify", done, total)

    return report


def _map_resident(fd: int, size: int, label: str) -> tuple[int, bool]:
    """Map the file shared read-only and keep its pages resident; (address, locked)."""
    if size == 0:
        return 0, False
    address = libc().mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, MAP_FAILED):
        err = ctypes.get_errno()
        raise TrimsError(f"cannot map the disk copy of {label}: {os.strerror(err)}")
    libc().madvise(address, size, mmap.MADV_HUGEPAGE)  # file THP where the kernel has it
    if libc().mlock(address, size) == 0:
        return address, True
    reason = os.strerror(ctypes.get_errno())
    if libc().madvise(address, size, MADV_POPULATE_READ) != 0:
        log.debug("model %s: mapping not populated (%s)", label, os.strerror(ctypes.get_errno()))
    log.debug("model %s: pages mapped, not locked (mlock: %s)", label, reason)
    return address, False
