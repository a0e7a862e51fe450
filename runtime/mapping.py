"""Host mappings of model buffers received from the store.

Note [Why a mapping outlives its lease]
---------------------------------------
The daemon hands over a descriptor of a sealed memfd (CPU tier) or of a verified disk-tier file.
We map it ``MAP_PRIVATE`` with ``PROT_READ | PROT_WRITE`` and close the descriptor at once::

    daemon memfd (sealed) ──fd──▶ mmap(MAP_PRIVATE) ──▶ numpy / torch / ORT / MXNet views
                                     │
                                     └─ a write copies that one page into this process only

The kernel keeps the pages alive while any mapping of them exists, so releasing the lease (or
losing the daemon) never invalidates memory a function still uses; the lease only tells the
daemon the model is in use, so it is not evicted or counted as idle. Writes are copy-on-write and
private: no tenant can change what another sees.

The manifest is checked against the mapped size before any view is built, so a view can never
reach outside the mapping. (CPython's ``mmap`` keeps a private duplicate of the descriptor
until the mapping is closed or collected; it is closed with the mapping, never leaked.)

Note [populate before the first request]
----------------------------------------
A fresh mapping has no page table entries: the first read of each page faults. For a sealed
memfd with 4 KiB pages (shmem huge pages off, the common case) the kernel maps 16 pages per
fault ("fault-around", ``fault_around_bytes`` = 64 KiB), so the first full read of a 512 MiB
model took about 8,200 faults and 79 ms against 19 ms warm on our 2-core machine. After the
node ran ``drop_caches`` fault-around no longer applies to that memfd (see docs/runtime.md,
"First request and instance start"): 131,000 faults, about 250 ms.

So :meth:`HostMapping.from_fd` starts a background thread that asks the kernel to fill the
page tables with ``madvise(MADV_POPULATE_READ)`` (Linux 5.14+) while the worker goes on with
the handler's import and init; the first request then reads at warm speed (about 20 ms and 40
faults for the same 512 MiB). ``POPULATE_READ`` maps the memfd's shared pages read-only, as a
read fault would: a later write still takes a private copy-on-write page, so isolation holds
(tests/runtime/test_mapping_populate.py). ``MAP_POPULATE`` is never used: on a private
writable mapping the kernel populates it with *write* faults, which would copy every page
into the process. Where ``POPULATE_READ`` is missing (EINVAL) the thread reads one byte per
page instead; any other failure only means the first request faults as before. The thread
calls ``madvise`` through ctypes, which releases the GIL, and :meth:`HostMapping.close` joins
it before unmapping, so it never touches a range that may be reused. The daemon's handle may
say ``"populate": false`` (a page-cache file in large folios, which maps in a few hundred
faults): then no thread is started, since it would only compete with the instance's start
(Note [who populates] in trims/daemon/tiers/pagecache.py).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from typing import Any

import numpy as np

from trims.errors import ValidationError
from trims.layout import Manifest
from trims.libc import MADV_POPULATE_READ, libc
from trims.runtime.adapters import numpy as numpy_adapter

log = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE


def _address(mm: mmap.mmap) -> int:
    """The mapping's first byte; the buffer export ends before this returns."""
    view = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def populate(mm: mmap.mmap, label: str) -> str:
    """Fill the page tables of ``mm`` for reading (Note [populate before the first request]).

    Returns how: "populate_read", "touched" (one read per page), or "skipped" (logged). Never
    raises for the kernel's refusal: the mapping works as before, the first reads fault.
    """
    size = len(mm)
    if size == 0:
        return "skipped"
    t0 = time.perf_counter()
    rc = libc().madvise(_address(mm), size, MADV_POPULATE_READ)
    err = ctypes.get_errno() if rc != 0 else 0
    if rc == 0:
        how = "populate_read"
    elif err == errno.EINVAL:
        # Kernel older than 5.14: read one byte per page (numpy releases the GIL for this).
        import numpy as np

        np.frombuffer(mm, dtype=np.uint8)[::_PAGE].max()
        how = "touched"
    else:
        log.debug("model %s: mapping not populated (%s); its first reads fault",
                  label, os.strerror(err))  # fmt: skip
        return "skipped"
    log.debug("model %s: %d MiB mapping populated (%s) in %.1f ms",
              label, size >> 20, how, (time.perf_counter() - t0) * 1e3)  # fmt: skip
    return how


class HostMapping:
    """A private, copy-on-write mapping of one model buffer plus its manifest."""

    def __init__(self, mm: mmap.mmap, manifest: Manifest, *, populate: bool = False) -> None:
        """``populate``: fill the page tables in a background thread (Note [populate before
        the first request]); :meth:`wait_populated` waits for it, :meth:`close` joins it."""
        self._mmap: mmap.mmap | None = mm
        self.manifest = manifest
        self._arrays: dict[str, np.ndarray[Any, Any]] | None = None
        #: How the mapping was populated ("populate_read", "touched", "skipped"); None while
        #: the thread runs or when it was not asked for.
        self.populated: str | None = None
        self._populating: threading.Thread | None = None
        if populate:
            thread = threading.Thread(
                target=self._populate, args=(mm,), name=f"populate-{manifest.name}", daemon=True
            )
            try:
                thread.start()
            except RuntimeError as e:  # no thread under a tight memory limit: fault instead
                log.debug("model %s: mapping not populated: %s", manifest.name, e)
                self.populated = "skipped"
            else:
                self._populating = thread

    def _populate(self, mm: mmap.mmap) -> None:
        try:
            self.populated = populate(mm, self.manifest.name)
        except Exception as e:  # never fail the instance for an optimisation
            log.debug("model %s: populating the mapping failed: %s", self.manifest.name, e)
            self.populated = "skipped"

    def wait_populated(self, timeout: float | None = None) -> bool:
        """Wait for the populate thread; True once it has finished (or none was started)."""
        thread = self._populating
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def populate_now(self) -> str:
        """Fill the page tables now, on this thread, whatever the daemon's hint said (a standby
        instance, which has time before its first request: Note [standby instances] in
        trims.runtime.gateway.pool); how it went, as :func:`populate` says it."""
        self.wait_populated()
        if self.populated in (None, "skipped"):
            self.populated = populate(self._require(), self.manifest.name)
        return self.populated

    @classmethod
    def from_fd(
        cls, fd: int, size: int, manifest: Manifest, *, populate: bool = True
    ) -> HostMapping:
        """Map ``size`` bytes of ``fd`` privately and close ``fd`` (also on failure); with
        ``populate`` its page tables fill in the background (Note [populate before the first
        request])."""
        try:
            actual = os.fstat(fd).st_size
            if size <= 0 or size > actual:
                raise ValidationError(
                    f"model {manifest.name}: the store announced {size} bytes but the "
                    f"descriptor holds {actual}; the daemon and client disagree, restart the "
                    "daemon"
                )
            if manifest.total_bytes > size:
                raise ValidationError(
                    f"model {manifest.name}: manifest describes {manifest.total_bytes} bytes "
                    f"but only {size} were mapped; the store entry is inconsistent, re-add it"
                )
            manifest.check_bounds()
            mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(mm, manifest, populate=populate)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def _require(self) -> mmap.mmap:
        if self._mmap is None:
            raise ValidationError(
                f"the mapping of model {self.manifest.name} was closed; acquire it again"
            )
        return self._mmap

    def buffer(self) -> memoryview:
        """The whole mapping as a writable (copy-on-write) byte view."""
        return memoryview(self._require())

    def address(self) -> int:
        """Virtual address of the mapping's first byte (for checks that views do not copy)."""
        arr = np.frombuffer(self._require(), dtype=np.uint8, count=1)
        return int(arr.ctypes.data)

    def numpy(self) -> dict[str, np.ndarray[Any, Any]]:
        """Zero-copy NumPy views per tensor (built once, then cached)."""
        if self._arrays is None:
            self._arrays = numpy_adapter.tensors(self._require(), self.manifest)
        return self._arrays

    def close(self) -> None:
        """Drop the mapping (after the populate thread ended). Views still alive keep it mapped
        until they are collected."""
        self.wait_populated()
        mm, self._mmap, self._arrays = self._mmap, None, None
        if mm is None:
            return
        try:
            mm.close()
        except BufferError:
            log.debug(
                "model %s: views into the mapping are still alive; it is unmapped when they "
                "are collected",
                self.manifest.name,
            )
