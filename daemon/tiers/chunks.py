"""Chunk digests: a layout's sha256 checked on every core (Note [chunk digests]).

Note [chunk digests]
~~~~~~~~~~~~~~~~~~~~
A layout's sha256 is one sequential hash: one core, about 1 GB/s on our 2-core test machine,
so every check of a 512 MiB model took ~530 ms, and every copy into a sealed memfd ~830 (the
copy alone ~330). Sealed memfds and GPU copies hash every byte on every load (Note [trusted
re-loads] in trims.daemon.residency says why they may not trust the file's stamp), and so does
any check of a blob whose stamp moved, or the first check after a daemon restart.

So whenever the daemon hashes a whole layout and it matches its digest (a commit, a disk
check, a first load), it also hashes each :data:`CHUNK` of it on a thread pool, beside the
sequential hash, and keeps those digests: they are facts about the content with that digest,
true forever. :class:`ChunkDigests` holds them in memory; the residency saves new ones in the
catalog (``chunk_digests``) and reads them back after a restart, so they are as trusted as the
catalog's own name-to-digest rows, and no more. A later check of the same digest needs no
sequential hash: it checks each chunk against them on every core (for a memfd, while the next
chunk is copied). 512 MiB into a memfd took ~450 ms instead of ~830 on two cores; the copy is
the floor.

A chunk that does not match is not taken on the recorded digests' word alone: the content is
hashed whole once more, and only a whole digest that differs fails the check (then
CorruptModel, and the blob is deleted, as always). So a wrong row in the catalog costs one
sequential hash, and is replaced, but can never make the daemon delete a good blob. On one CPU
the chunk hashes would only double the hashing, so only a first memfd load computes them there
(its re-loads then check them at the same cost as the whole hash); a commit, a disk check or a
page-cache or GPU load computes none.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from trims.protocol import Progress

log = logging.getLogger(__name__)

#: Bytes per chunk digest, and per read or copy step: small enough to hash while in cache.
CHUNK = 4 << 20
#: sha256 digest size: a row of chunk digests is their concatenation.
DIGEST_BYTES = 32

Piece = bytes | memoryview


def chunk_count(size: int) -> int:
    """How many chunk digests a layout of ``size`` bytes has."""
    return -(-size // CHUNK)


def _sha256(chunk: Piece) -> bytes:
    return hashlib.sha256(chunk).digest()


class ChunkDigests:
    """The thread pool that hashes chunks, and the chunk digests of each layout verified whole,
    by layout digest (Note [chunk digests]). Thread-safe."""

    def __init__(self, workers: int | None = None) -> None:
        #: The CPUs we may use: the pool's size.
        self.workers = workers or len(os.sched_getaffinity(0)) or 1
        self._pool: ThreadPoolExecutor | None = None
        self._known: dict[str, tuple[bytes, ...]] = {}
        self._unsaved: set[str] = set()
        self._lock = threading.Lock()

    @property
    def parallel(self) -> bool:
        """Whether hashing chunks beside the sequential hash costs no wall time (a free core)."""
        return self.workers > 1

    def get(self, digest: str, size: int | None = None) -> tuple[bytes, ...] | None:
        """The chunk digests of ``digest``; None if unknown (or not ``size``'s count)."""
        with self._lock:
            known = self._known.get(digest)
        if known is None or (size is not None and len(known) != chunk_count(size)):
            return None
        return known

    def keep(self, digest: str, chunks: tuple[bytes, ...]) -> None:
        """Chunk digests just computed from content that hashed whole to ``digest``."""
        with self._lock:
            self._known[digest] = chunks
            self._unsaved.add(digest)

    def learn(self, digest: str, chunks: tuple[bytes, ...]) -> None:
        """Chunk digests read back from where they were saved (so not unsaved)."""
        with self._lock:
            self._known.setdefault(digest, chunks)

    def forget(self, digest: str) -> None:
        with self._lock:
            self._known.pop(digest, None)
            self._unsaved.discard(digest)

    def take_unsaved(self) -> dict[str, tuple[bytes, ...]]:
        """The digests kept since the last call, to save."""
        with self._lock:
            unsaved, self._unsaved = self._unsaved, set()
            return {d: self._known[d] for d in unsaved if d in self._known}

    def submit(self, chunk: Piece) -> Future[bytes]:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="trims-hash")
            pool = self._pool
        return pool.submit(_sha256, chunk)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def hash_pieces(
    pieces: Iterable[Piece], pool: ChunkDigests, known: tuple[bytes, ...] | None, each: bool
) -> tuple[str | None, tuple[bytes, ...]]:
    """Hash ``pieces`` (the content, :data:`CHUNK` bytes each, the last maybe shorter): (the
    whole sha256, or None when ``known`` chunk digests are given; each piece's digest, computed
    on the pool, or () when neither ``known`` nor ``each``).

    At most two pieces per worker wait for the pool, so reading ahead stays bounded; beside a
    whole hash, which takes a core of its own, at most one per other worker. A piece
    that is a memoryview is released once hashed (slices of a mapping must be, before it can
    be closed).
    """
    whole = None if known is not None else hashlib.sha256()
    each = each or known is not None
    pending: collections.deque[tuple[Future[bytes], Piece]] = collections.deque()
    digests: list[bytes] = []
    limit = 2 * pool.workers if whole is None else max(1, pool.workers - 1)

    def finish(f: Future[bytes], piece: Piece, cancel: bool = False) -> None:
        """Wait until the pool is done with ``piece`` (or cancel it), then release it."""
        try:
            if not (cancel and f.cancel()):
                f.exception()
        finally:
            if isinstance(piece, memoryview):
                piece.release()

    try:
        for piece in pieces:
            if each:
                pending.append((pool.submit(piece), piece))
                while len(pending) > limit:
                    f, old = pending.popleft()
                    finish(f, old)
                    digests.append(f.result())
            if whole is not None:
                whole.update(piece)
            if not each and isinstance(piece, memoryview):
                piece.release()
        while pending:
            f, old = pending.popleft()
            finish(f, old)
            digests.append(f.result())
    finally:
        while pending:
            finish(*pending.popleft(), cancel=True)
    return None if whole is None else whole.hexdigest(), tuple(digests)


class Checked(NamedTuple):
    """What a check found."""

    #: The content's sha256: the expected digest when its known chunks all matched.
    actual: str
    #: (start, end) of the first chunk that differed from the known digests, if one did.
    differ: tuple[int, int] | None = None


def check(
    digest: str,
    size: int,
    read: Callable[[], Iterator[Piece]],
    pool: ChunkDigests | None,
    *,
    each: bool | None = None,
) -> Checked:
    """Check the content ``read()`` yields (``size`` bytes in :data:`CHUNK` pieces) against
    ``digest``: by its known chunk digests on the pool when there are some, else by the whole
    sha256, computing chunk digests beside it (``each``, by default when a core is free) and
    keeping them when the whole matched. A chunk mismatch hashes everything again whole
    (``read`` is called a second time) before the check fails (Note [chunk digests]).
    """
    if pool is None:
        actual, _ = hash_pieces(read(), ChunkDigests(1), None, False)
        assert actual is not None
        return Checked(actual)
    known = pool.get(digest, size)
    if known is not None:
        _, digests = hash_pieces(read(), pool, known, True)
        if digests == known:
            return Checked(digest)
        pairs = enumerate(zip(digests, known, strict=False))
        bad = next((i for i, (a, b) in pairs if a != b), min(len(digests), len(known)))
        differ = (bad * CHUNK, min((bad + 1) * CHUNK, size))
        log.warning(
            "layout %s: bytes %d to %d differ from the copy verified before; hashing it whole",
            digest[:12],
            *differ,
        )
        pool.forget(digest)
    else:
        differ = None
    if differ is not None or each is None:
        each = differ is not None or pool.parallel  # wrong digests are replaced
    actual, digests = hash_pieces(read(), pool, None, each)
    assert actual is not None
    if actual != digest:
        return Checked(actual, differ)
    if differ is not None:
        log.warning("layout %s: its recorded chunk digests were wrong; replaced", digest[:12])
    if digests:
        pool.keep(digest, digests)
    return Checked(actual)


def view_pieces(view: memoryview, size: int) -> Iterator[memoryview]:
    """``view``'s first ``size`` bytes in :data:`CHUNK` slices (:func:`hash_pieces` releases
    them)."""
    for start in range(0, size, CHUNK):
        yield view[start : min(start + CHUNK, size)]


def file_pieces(
    fd: int,
    size: int,
    progress: Progress | None = None,
    stage: str = "verify",
    *,
    direct: bool = False,
) -> Iterator[bytes]:
    """The first ``size`` bytes of ``fd`` (by ``pread``, its offset left alone) in
    :data:`CHUNK` pieces, reporting ``stage``; EOFError when the file is shorter.

    With ``direct`` (``fd`` opened ``O_DIRECT``) each read goes to the device past the page
    cache (the kernel writes dirty cached pages back first), a whole chunk into a page-aligned
    buffer at a chunk-aligned offset, as direct I/O requires."""
    buf = mmap.mmap(-1, CHUNK) if direct else None
    try:
        done = 0
        while done < size:
            want = min(CHUNK, size - done)
            if buf is None:
                piece = os.pread(fd, want, done)
            else:  # a short read ends the file: the next offset would not be aligned
                piece = buf[: min(os.preadv(fd, [buf], done), want)]
                if len(piece) < want:
                    raise EOFError(size - done - len(piece))
            if not piece:
                raise EOFError(size - done)
            done += len(piece)
            yield piece
            if progress is not None:
                progress(stage, done, size)
    finally:
        if buf is not None:
            buf.close()
