"""GPU transfer modalities through CuPy (needs an NVIDIA GPU; see :mod:`trims.kernels.gpu`).

Each measurement is timed with CUDA events on one stream, after a warm-up:

- ``h2d-pageable`` / ``h2d-pinned`` / ``h2d-write-combined``: cudaMemcpy host -> device from a
  NumPy buffer, page-locked memory, or write-combined page-locked memory, with the host cache
  warm or flushed;
- ``d2h-pageable`` / ``d2h-pinned``: device -> host;
- ``managed-prefetch`` / ``managed-demand``: managed memory last touched by the host, read by a
  kernel after cudaMemPrefetchAsync to the device, or directly (pages migrate on fault);
- ``zero-copy``: a kernel reads mapped page-locked host memory over the interconnect;
- ``d2d``: device -> device copy.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from trims.kernels.gpu import require_cupy

log = logging.getLogger(__name__)

H2D, D2H, D2D = 1, 2, 3
HOST_ALLOC_MAPPED = 2
HOST_ALLOC_WRITE_COMBINED = 4
FLUSH_BYTES = 64 << 20

Row = tuple[str, int, str, float, str]


class _Gpu:
    def __init__(self) -> None:
        self.cp = require_cupy()
        self.rt = self.cp.cuda.runtime
        self.stream = self.cp.cuda.Stream(non_blocking=True)
        self.device = self.cp.cuda.Device().id
        self._flush = np.ones(FLUSH_BYTES // 8, np.uint64)

    def flush(self) -> None:
        self._flush += np.uint64(1)

    def time(self, op: Callable[[], None], prep: Callable[[], None], repeat: int) -> float:
        """Median seconds between CUDA events around ``op`` (``prep`` untimed before each)."""
        cp = self.cp
        prep()
        op()
        self.stream.synchronize()
        times = []
        for _ in range(max(1, repeat)):
            prep()
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(self.stream)
            op()
            end.record(self.stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
        return float(np.median(times))

    def memcpy(self, dst: int, src: int, n: int, kind: int) -> None:
        self.rt.memcpyAsync(dst, src, n, kind, self.stream.ptr)

    def device_view(self, ptr: int, n: int, owner: Any) -> Any:
        """A uint64 CuPy array over device-accessible memory at ``ptr`` (no copy)."""
        cp = self.cp
        mem = cp.cuda.UnownedMemory(ptr, n, owner)
        return cp.ndarray((n // 8,), cp.uint64, cp.cuda.MemoryPointer(mem, 0))

    def read_kernel(self, view: Any) -> None:
        """A kernel that reads every word (a sum reduction) on our stream."""
        with self.stream:
            view.sum()


def run(sizes: list[int], repeat: int) -> list[Row]:
    g = _Gpu()
    rows: list[Row] = []
    for size in sizes:
        rows += _copies(g, size, repeat)
        rows += _managed(g, size, repeat)
        rows += _zero_copy(g, size, repeat)
    return rows


def _copies(g: _Gpu, size: int, repeat: int) -> list[Row]:
    cp, rt = g.cp, g.rt
    rows: list[Row] = []
    dev = cp.empty(size, cp.uint8)
    dev2 = cp.empty(size, cp.uint8)
    pageable = np.ones(size, np.uint8)
    pinned_mem = cp.cuda.alloc_pinned_memory(size)
    pinned = np.frombuffer(pinned_mem, np.uint8, size)
    pinned[:] = 1
    wc_ptr = rt.hostAlloc(size, HOST_ALLOC_WRITE_COMBINED)
    try:
        ctypes.memset(wc_ptr, 1, size)
        hosts = {
            "pageable": pageable.ctypes.data,
            "pinned": pinned.ctypes.data,
            "write-combined": wc_ptr,
        }
        for name, host in hosts.items():
            for cache, prep in (("warm", lambda: None), ("flushed", g.flush)):

                def h2d(h: int = host) -> None:
                    g.memcpy(dev.data.ptr, h, size, H2D)

                rows.append((f"h2d-{name}", size, cache, g.time(h2d, prep, repeat), "gpu"))
                if name == "write-combined":
                    continue

                def d2h(h: int = host) -> None:
                    g.memcpy(h, dev.data.ptr, size, D2H)

                rows.append((f"d2h-{name}", size, cache, g.time(d2h, prep, repeat), "gpu"))

        def d2d() -> None:
            g.memcpy(dev2.data.ptr, dev.data.ptr, size, D2D)

        rows.append(("d2d", size, "n/a", g.time(d2d, lambda: None, repeat), "gpu"))
    finally:
        rt.freeHost(wc_ptr)
    return rows


def _managed(g: _Gpu, size: int, repeat: int) -> list[Row]:
    """Managed memory touched by the host before each run, then read by a kernel."""
    cp, rt = g.cp, g.rt
    mem = cp.cuda.malloc_managed(size)
    host = (ctypes.c_uint8 * size).from_address(mem.ptr)
    view = g.device_view(mem.ptr, size, mem)

    def host_touch() -> None:
        g.stream.synchronize()
        ctypes.memset(ctypes.addressof(host), 1, size)

    def prefetch_then_read() -> None:
        rt.memPrefetchAsync(mem.ptr, size, g.device, g.stream.ptr)
        g.read_kernel(view)

    def demand_read() -> None:
        g.read_kernel(view)

    rows: list[Row] = []
    try:
        rows.append(("managed-prefetch", size, "n/a", g.time(prefetch_then_read, host_touch,
                                                             repeat), "gpu"))  # fmt: skip
    except Exception as e:  # CUDARuntimeError, or a signature change across CUDA versions
        log.warning("managed prefetch of %d bytes not measured: %s", size, e)
    rows.append(("managed-demand", size, "n/a", g.time(demand_read, host_touch, repeat), "gpu"))
    return rows


def _zero_copy(g: _Gpu, size: int, repeat: int) -> list[Row]:
    rt = g.rt
    ptr = rt.hostAlloc(size, HOST_ALLOC_MAPPED)
    try:
        ctypes.memset(ptr, 1, size)
        # with unified virtual addressing (64-bit Linux) the mapped host pointer is also the
        # device pointer; pointerGetAttributes says so explicitly where CuPy exposes it
        getattrs = getattr(rt, "pointerGetAttributes", None)
        dptr = int(getattrs(ptr).devicePointer) if getattrs else ptr
        view = g.device_view(dptr, size, None)
        secs = g.time(lambda: g.read_kernel(view), lambda: None, repeat)
        return [("zero-copy", size, "n/a", secs, "gpu")]
    finally:
        rt.freeHost(ptr)
