"""The disk tier: a content-addressed directory of canonical layouts.

::

    root/
      blobs/<sha256>        the layout buffer, read-only (mode 0400)
      blobs/<sha256>.json   its manifest (the first one committed for that content; 0400)
      tmp/<uuid>.part       files being written: downloads, conversions, manifests

Every folder is 0700 and every file owner-only, all of the daemon's uid, checked and tightened
when the tier opens (Note [private store] in :mod:`trims.daemon.private`).

Invariants: a blob is only ever created by renaming a fully written, fsynced temp file whose
sha256 was recomputed and matched, and its manifest is written the same way afterwards, so a
crash leaves either a complete entry, an orphan (cleaned at start-up) or a ``.part`` file
(cleaned at start-up), never a half-written blob. :meth:`DiskTier.verify` recomputes the digest
before a blob is served and deletes a blob that fails it, so a damaged or changed blob is never
served again. :meth:`DiskTier.stamp` is what the residency compares to decide that a verified
blob may have changed since (Note [disk re-verification] in :mod:`trims.daemon.residency`).
Which blobs may exist at all is the catalog's business (Note [commit protocol] in
:mod:`trims.daemon.store`). Several models may share one blob when their layouts are identical.

Note [scrub reads the device]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A scrub (``trims models verify``) exists to find damage before a load meets it. A buffered
read is answered by the page cache wherever the blob is cached, and a served model's blob
usually is (the CPU tier's page-cache backing keeps it mapped and locked), so a scrub that read
through the cache would vouch for the cached copy while the device beneath holds rotten
sectors: the next restart, or the next load after the cache let go, would read those. So a
scrub opens the blob ``O_DIRECT``: the kernel first writes back any dirty cached pages of the
range (so a write through a mapping is still seen), then reads the device. Ordinary checks
(commit, first use, a moved stamp) read through the cache: they check what is about to be
served. A filesystem without direct I/O (some FUSE and network filesystems) makes the scrub
read the cache, with a log line saying so. Reading the device costs the page-cache hits a warm
scrub had; a scrub is rare and already reads every byte.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import uuid
from pathlib import Path
from typing import NamedTuple

from trims.config import format_size
from trims.daemon.crashpoints import crashpoint
from trims.daemon.private import private_dir, private_files
from trims.daemon.tiers import chunks
from trims.daemon.tiers.chunks import Checked, ChunkDigests
from trims.errors import CorruptModel, NotFound, ResourceExhausted, ValidationError
from trims.layout import Manifest, validate_digest
from trims.protocol import Progress

log = logging.getLogger(__name__)


class Stamp(NamedTuple):
    """What changes when a file is written, replaced or has its mode changed. ``ctime`` is set
    by the kernel on any of these and cannot be set back from userspace."""

    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Stamp:
        return cls(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def fsync_dir(path: Path) -> None:
    """Make renames and unlinks in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_file(
    source: Path | int,
    size: int,
    digest: str,
    pool: ChunkDigests | None,
    progress: Progress | None = None,
    *,
    direct: bool = False,
) -> Checked:
    """Check the first ``size`` bytes of ``source`` (a path, or an open descriptor, read with
    ``pread`` so its offset is left alone) against ``digest``, by its chunk digests on
    ``pool`` when known (Note [chunk digests] in :mod:`trims.daemon.tiers.chunks`), reporting
    stage "verify". CorruptModel when the file is shorter.

    ``direct`` reads a path's bytes from the device rather than the page cache (Note [scrub
    reads the device]), where its filesystem allows direct I/O."""
    if isinstance(source, int):
        fd = source
    else:
        fd = _open_direct(source) if direct else -1
        if fd < 0:
            direct = False
            fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return chunks.check(
            digest, size, lambda: chunks.file_pieces(fd, size, progress, direct=direct), pool
        )
    except EOFError as e:
        name = source.name if isinstance(source, Path) else "the file"
        raise CorruptModel(f"{name} is truncated: {e.args[0]} of {size} bytes missing") from e
    finally:
        if fd is not source:
            os.close(fd)


def _open_direct(path: Path) -> int:
    """``path`` opened for direct I/O; -1 (and a log line) where its filesystem has none."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        if path.parent not in _NO_DIRECT_IO:  # said once per folder, not once per blob
            _NO_DIRECT_IO.add(path.parent)
            log.info(
                "%s: the filesystem has no direct I/O, so a scrub checks the bytes the page "
                "cache holds, not the device's",
                path.parent,
            )
        return -1


#: folders whose filesystem refused O_DIRECT (:func:`_open_direct` has logged it)
_NO_DIRECT_IO: set[Path] = set()


def open_copy(source: Path, digest: str, label: str) -> int:
    """A read-only fd of the disk copy a memory tier loads from; CorruptModel if it is gone."""
    try:
        return os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise CorruptModel(
            f"the disk copy of {label} is missing ({digest[:12]}); remove the model and add it "
            "again"
        ) from e


def check_copy_digest(actual: str, digest: str, label: str) -> None:
    """CorruptModel unless what a memory tier hashed as it loaded is ``digest``."""
    if actual != digest:
        raise CorruptModel(
            f"the disk copy of {label} fails its digest check (expected {digest[:12]}, got "
            f"{actual[:12]}); remove the model and add it again"
        )


class DiskTier:
    """Content-addressed layouts under ``root`` within a byte ``budget`` (0 disables the tier).

    Thread-safe: the daemon commits from worker threads while it serves from the event loop.
    """

    def __init__(self, root: Path, budget: int, pool: ChunkDigests | None = None) -> None:
        if budget < 0:
            raise ValidationError(f"disk tier budget {budget} must not be negative")
        self.root = root
        self.budget = budget
        self._blobs = root / "blobs"
        self._tmp = root / "tmp"
        for folder in (root, self._blobs, self._tmp):
            private_dir(folder)
        private_files(self._blobs)
        self._lock = threading.Lock()
        #: Where chunk digests are computed and kept (None: whole hashes only).
        self.pool = pool
        self._sizes: dict[str, int] = {}
        #: Blobs this tier placed after hashing them, with their stamp once in place.
        self._placed: dict[str, Stamp] = {}
        for blob in self._blobs.iterdir():
            if blob.suffix == "" and blob.with_suffix(".json").exists():
                self._sizes[blob.name] = blob.stat().st_size

    def new_temp(self) -> Path:
        """A fresh path under root/tmp for the caller to write (not created here)."""
        return self._tmp / f"{uuid.uuid4().hex}.part"

    def path(self, digest: str) -> Path:
        return self._blobs / validate_digest(digest)

    def _manifest_path(self, digest: str) -> Path:
        return self._blobs / f"{validate_digest(digest)}.json"

    def contains(self, digest: str) -> bool:
        with self._lock:
            return validate_digest(digest) in self._sizes

    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def free_bytes(self) -> int:
        return max(self.budget - self.used_bytes(), 0)

    def digests(self) -> list[str]:
        with self._lock:
            return sorted(self._sizes)

    def commit(self, temp: Path, manifest: Manifest, progress: Progress | None = None) -> None:
        """Verify ``temp`` against ``manifest`` and move it into place; idempotent.

        CorruptModel (and ``temp`` removed) when its size or sha256 does not match;
        ResourceExhausted (and ``temp`` removed) when it does not fit the budget.
        """
        digest = validate_digest(manifest.digest)
        try:
            size = temp.stat().st_size
            if size != manifest.total_bytes:
                raise CorruptModel(
                    f"layout of {manifest.name}:{manifest.version} has {size} bytes, its "
                    f"manifest says {manifest.total_bytes}; it was not stored"
                )
            actual = check_file(temp, size, digest, self.pool, progress).actual
            if actual != digest:
                raise CorruptModel(
                    f"layout of {manifest.name}:{manifest.version} has sha256 {actual}, its "
                    f"manifest says {digest}; it was not stored"
                )
            with self._lock:
                if digest in self._sizes:
                    temp.unlink()
                    log.info("model %s: layout %s already on disk", manifest.name, digest[:12])
                    return
                used = sum(self._sizes.values())
                if used + size > self.budget:
                    raise ResourceExhausted(
                        f"model {manifest.name} ({format_size(size)}) does not fit the disk tier "
                        f"(budget {format_size(self.budget)}, used {format_size(used)}); "
                        "remove models or raise --disk-budget",
                        needed=size,
                        budget=self.budget,
                        used=used,
                    )
                self._place(temp, manifest)
                self._sizes[digest] = size
                self._placed[digest] = Stamp.of(self.path(digest).stat())
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        log.info(
            "model %s:%s stored on disk as %s (%s)",
            manifest.name,
            manifest.version,
            digest[:12],
            format_size(size),
        )

    def _place(self, temp: Path, manifest: Manifest) -> None:
        blob = self._blobs / manifest.digest
        with open(temp, "rb") as f:
            os.fchmod(f.fileno(), 0o400)
            os.fsync(f.fileno())
        meta_temp = self.new_temp()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        with open(os.open(meta_temp, flags, 0o400), "w", encoding="utf-8") as f:
            json.dump(manifest.to_dict(), f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.rename(temp, blob)
            crashpoint("add.blob_renamed")
            os.rename(meta_temp, self._manifest_path(manifest.digest))
        finally:
            meta_temp.unlink(missing_ok=True)
        fsync_dir(self._blobs)

    def manifest(self, digest: str) -> Manifest:
        try:
            text = self._manifest_path(digest).read_text(encoding="utf-8")
        except FileNotFoundError as e:
            raise NotFound(f"layout {digest} is not on disk") from e
        try:
            return Manifest.from_dict(json.loads(text))
        except (json.JSONDecodeError, ValidationError) as e:
            raise CorruptModel(
                f"manifest of layout {digest} on disk is unreadable ({e}); remove the model and "
                "add it again"
            ) from e

    def take_placed(self, digest: str) -> Stamp | None:
        """The stamp ``digest``'s blob had when :meth:`commit` placed it, hashed, if this tier
        placed it since the last call; None when a commit found it already on disk (then
        nothing vouches for the blob that was there)."""
        with self._lock:
            return self._placed.pop(digest, None)

    def stamp(self, digest: str) -> Stamp | None:
        """The blob's current :class:`Stamp`; None when it is not on disk."""
        try:
            return Stamp.of(self.path(digest).stat())
        except FileNotFoundError:
            return None

    def verify(
        self, digest: str, progress: Progress | None = None, *, direct: bool = False
    ) -> Stamp:
        """Recompute the blob's sha256 (reporting stage "verify"), reading the device past the
        page cache with ``direct`` (Note [scrub reads the device]); return the stamp it was
        verified under.

        A blob that fails (wrong size or digest, unreadable manifest, changed while it was
        hashed) is deleted at once, then CorruptModel is raised: it is never served again.
        """
        try:
            return self._verify(digest, progress, direct)
        except CorruptModel as e:
            if self.contains(digest) or self.path(digest).exists():
                self.remove(digest)
            log.warning(
                "layout %s deleted from the disk tier: it failed its digest check (%s)",
                digest,
                e.message,
            )
            raise CorruptModel(
                f"{e.message}; the damaged copy was deleted from the disk tier"
            ) from e

    def _verify(self, digest: str, progress: Progress | None, direct: bool) -> Stamp:
        manifest = self.manifest(digest)
        blob = self.path(digest)
        try:
            before = Stamp.of(blob.stat())
        except FileNotFoundError as e:
            raise NotFound(f"layout {digest} is not on disk") from e
        if before.size != manifest.total_bytes:
            raise CorruptModel(
                f"layout {digest} of {manifest.name} on disk has {before.size} bytes instead "
                f"of {manifest.total_bytes}; remove the model and add it again"
            )
        try:
            actual = check_file(
                blob, before.size, digest, self.pool, progress, direct=direct
            ).actual
        except CorruptModel as e:
            raise CorruptModel(f"layout {digest} of {manifest.name}: {e}") from e
        if actual != digest:
            raise CorruptModel(
                f"layout {digest} of {manifest.name} on disk has sha256 {actual}: the file is "
                "damaged; remove the model and add it again"
            )
        if self.stamp(digest) != before:
            raise CorruptModel(
                f"layout {digest} of {manifest.name} changed on disk while it was verified; "
                "remove the model and add it again"
            )
        return before

    def remove(self, digest: str) -> None:
        """Delete a blob and its manifest; NotFound when neither exists."""
        blob, meta = self.path(digest), self._manifest_path(digest)
        with self._lock:
            existed = blob.exists() or meta.exists()
            meta.unlink(missing_ok=True)
            blob.unlink(missing_ok=True)
            size = self._sizes.pop(digest, 0)
            self._placed.pop(digest, None)
        if not existed:
            raise NotFound(f"layout {digest} is not on disk")
        fsync_dir(self._blobs)
        log.info("layout %s removed from disk (%s freed)", digest[:12], format_size(size))

    def cleanup_temps(self) -> int:
        """Delete leftover ``.part`` files and orphan blobs/manifests; return how many."""
        removed = 0
        with self._lock:
            for part in self._tmp.iterdir():
                part.unlink(missing_ok=True)
                removed += 1
            for entry in self._blobs.iterdir():
                if entry.suffix == ".json":
                    orphan = not entry.with_suffix("").exists()
                else:
                    orphan = entry.name not in self._sizes
                if orphan:
                    entry.unlink(missing_ok=True)
                    removed += 1
        if removed:
            fsync_dir(self._blobs)
            log.info("disk tier %s: removed %d leftover partial files", self.root, removed)
        return removed
