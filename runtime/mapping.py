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
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any

import numpy as np

from trims.errors import ValidationError
from trims.layout import Manifest
from trims.runtime.adapters import numpy as numpy_adapter

log = logging.getLogger(__name__)


class HostMapping:
    """A private, copy-on-write mapping of one model buffer plus its manifest."""

    def __init__(self, mm: mmap.mmap, manifest: Manifest) -> None:
        self._mmap: mmap.mmap | None = mm
        self.manifest = manifest
        self._arrays: dict[str, np.ndarray[Any, Any]] | None = None

    @classmethod
    def from_fd(cls, fd: int, size: int, manifest: Manifest) -> HostMapping:
        """Map ``size`` bytes of ``fd`` privately and close ``fd`` (also on failure)."""
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
        return cls(mm, manifest)

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
        """Drop the mapping. Views still alive keep it mapped until they are collected."""
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
