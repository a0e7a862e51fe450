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

Note [chunk digests]
~~~~~~~~~~~~~~~~~~~~
A layout's sha256 is one sequential hash: one core, about 1 GB/s on our 2-core test machine,
so every copy of a 512 MiB model into a memfd took ~830 ms, of which the copy alone was ~330.
A memfd copy is hashed on *every* load, also the re-load of a model evicted from memory (Note
[trusted re-loads] in trims.daemon.residency says why it may not trust the file's stamp). So
the first load also hashes each :data:`CHUNK` of the copy on a thread pool, beside the
sequential hash, and :class:`ChunkDigests` keeps those digests, in the daemon's memory only,
once the whole copy matched the manifest digest: they are then facts about the content with
that digest. A re-load checks each chunk against them, on every core, while the next chunk is
copied, and needs no sequential hash: 512 MiB took ~450 ms instead of ~830 on two cores
(every core helps; the copy is the floor). The first load costs no more wall time where a core
is free (the chunk hashes run beside the sequential one), twice the hashing CPU. A daemon
restart forgets the digests; its first load of each model hashes sequentially again. A chunk
that does not match fails the load like a wrong digest (CorruptModel).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from trims.daemon.tiers.disk import Stamp, check_copy_digest, open_copy
from trims.errors import CorruptModel, TrimsError
from trims.protocol import Progress

SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
#: Bytes copied and hashed per step, and per chunk digest: small enough to hash while still in
#: cache (Note [chunk digests]).
CHUNK = 4 << 20


def _chunk_sha256(chunk: memoryview) -> bytes:
    return hashlib.sha256(chunk).digest()


class ChunkDigests:
    """The thread pool that hashes chunks, and the digests of each layout's chunks by layout
    digest, kept once a copy verified whole (Note [chunk digests]). Thread-safe."""

    def __init__(self, workers: int | None = None) -> None:
        self._workers = workers or len(os.sched_getaffinity(0)) or 1  # the CPUs we may use
        self._pool: ThreadPoolExecutor | None = None
        self._known: dict[str, tuple[bytes, ...]] = {}
        self._lock = threading.Lock()

    def get(self, digest: str) -> tuple[bytes, ...] | None:
        with self._lock:
            return self._known.get(digest)

    def keep(self, digest: str, chunks: tuple[bytes, ...]) -> None:
        with self._lock:
            self._known[digest] = chunks

    def submit(self, chunk: memoryview) -> Future[bytes]:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="trims-hash")
            pool = self._pool
        return pool.submit(_chunk_sha256, chunk)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


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


def _fill_and_hash(
    src: int,
    dst: int,
    size: int,
    chunks: ChunkDigests,
    known: tuple[bytes, ...] | None,
    progress: Progress | None,
) -> tuple[int, str | None, tuple[bytes, ...]]:
    """Copy ``size`` bytes of ``src`` into the memfd ``dst``, hashing each chunk as it is
    written (Note [sealed memfd]); (bytes copied, sha256 of them or None when ``known`` chunk
    digests are given, the chunks' digests).

    Each chunk's digest is computed on the pool while the next one is copied (Note [chunk
    digests]); without ``known``, the whole copy is also hashed sequentially here.
    """
    whole = None if known is not None else hashlib.sha256()
    if size == 0:
        return 0, None if whole is None else whole.hexdigest(), ()
    done = 0
    pending: list[Future[bytes]] = []
    views: list[memoryview] = []
    report: Callable[[str, int, int | None], None] = progress or (lambda *_: None)
    with mmap.mmap(dst, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
        with contextlib.suppress(OSError):
            m.madvise(mmap.MADV_HUGEPAGE)  # Note [huge pages] in trims.daemon.tiers.cpu
        with memoryview(m) as view:
            try:
                while done < size:
                    chunk = view[done : min(done + CHUNK, size)]
                    views.append(chunk)
                    n = _read_chunk(src, chunk, done)
                    if n < len(chunk):
                        done += n
                        break
                    pending.append(chunks.submit(chunk))
                    done += n
                    report("load", done, size)
                    if whole is not None:
                        whole.update(chunk)
                        report("verify", done, size)
                digests = tuple(f.result() for f in pending)
            finally:
                for f in pending:  # the pool must be done with the mapping before it goes
                    if not f.cancel():
                        f.exception()
                for chunk in views:
                    chunk.release()
    if known is not None:
        report("verify", done, size)
    return done, None if whole is None else whole.hexdigest(), digests


def create_sealed_memfd(
    source: Path,
    size: int,
    digest: str,
    label: str,
    chunks: ChunkDigests,
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
        known = chunks.get(digest)
        try:
            before = Stamp.of(os.fstat(src))
            copied, actual, digests = _fill_and_hash(src, fd, size, chunks, known, progress)
            stamp = before if Stamp.of(os.fstat(src)) == before else None
        finally:
            os.close(src)
        if copied != size:
            raise CorruptModel(
                f"the disk copy of {label} is truncated: {copied} of {size} bytes; remove the "
                "model and add it again"
            )
        if known is None:
            assert actual is not None
            check_copy_digest(actual, digest, label)
            chunks.keep(digest, digests)
        elif digests != known:
            pairs = enumerate(zip(digests, known, strict=False))
            bad = next((i for i, (a, b) in pairs if a != b), min(len(digests), len(known)))
            raise CorruptModel(
                f"the disk copy of {label} fails its digest check (bytes {bad * CHUNK} to "
                f"{min((bad + 1) * CHUNK, size)} differ from the copy verified before); remove "
                "the model and add it again"
            )
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd, stamp
