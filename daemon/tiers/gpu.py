"""GPU tier: device memory that other processes import, through the CUDA driver API (ctypes).

Note [exported device memory]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
::

    cuMemCreate(POSIX_FD handle type, size rounded up to the allocation granularity)
      └─ cuMemAddressReserve + cuMemMap + cuMemSetAccess(rw, daemon only)
           └─ cuMemcpyHtoD(verified disk layout)              (daemon's copy-in)
      └─ cuMemExportToShareableHandle -> fd ──SCM_RIGHTS──> client
                                               cuMemImportFromShareableHandle + cuMemMap
                                               + cuMemSetAccess(read-only where supported)

The daemon keeps the allocation handle, its own mapping and the exported fd until the model
leaves the tier, which happens only when no lease holds it (Note [lease keeps memory alive]).
Where the device lacks POSIX-fd handles (or VMM), the legacy runtime path is used: cudaMalloc +
cudaIpcGetMemHandle, sent as hex with no fd. Devices are named by UUID ("GPU-xxxxxxxx-...").
Every CUresult other than success becomes a TrimsError naming the call and the CUDA error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trims.cuda import (
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    CUDA_MEMCPY_HOST_TO_DEVICE,
    CudaDriver,
    CudaError,
    load_library,
)
from trims.daemon.tiers import chunks
from trims.daemon.tiers.chunks import ChunkDigests
from trims.daemon.tiers.disk import Stamp
from trims.daemon.tiers.memory import Export, Loaded
from trims.errors import CorruptModel, TrimsError, Unavailable
from trims.protocol import Progress

log = logging.getLogger(__name__)

CUDART_NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12")


@dataclass
class _Allocation:
    size: int
    alloc_size: int
    handle: int
    ptr: int
    fd: int | None
    ipc_handle: str | None = None


def round_up(n: int, granularity: int) -> int:
    return (max(n, 1) + granularity - 1) // granularity * granularity


def _host_view(
    source: Path, size: int, digest: str, label: str, pool: ChunkDigests | None
) -> mmap.mmap:
    """A private mapping of the verified disk layout (ctypes needs a writable buffer), checked
    by its chunk digests on ``pool`` when known (Note [chunk digests] in
    :mod:`trims.daemon.tiers.chunks`)."""
    with open(source, "rb") as f:
        if os.fstat(f.fileno()).st_size < size:
            raise CorruptModel(f"the disk copy of {label} is truncated; remove it and add it again")
        view = mmap.mmap(
            f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    try:
        with memoryview(view) as whole:
            checked = chunks.check(digest, size, lambda: chunks.view_pieces(whole, size), pool)
        if checked.actual != digest:
            raise CorruptModel(f"the disk copy of {label} fails its digest check; add it again")
    except BaseException:
        view.close()
        raise
    return view


class GpuTier:
    """Exported device memory on one CUDA device, by digest."""

    name = "gpu"

    def __init__(self, driver: CudaDriver, ordinal: int = 0) -> None:
        self.driver = driver
        self.ordinal = ordinal
        self.device = driver.device(ordinal)
        self.uuid = driver.uuid(self.device)
        self._ctx = driver.primary_context(self.device)
        self.vmm = bool(
            driver.attribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, self.device)
            and driver.attribute(
                CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, self.device
            )
        )
        self._prop = driver.allocation_prop(self.device)
        self.granularity = driver.granularity(self._prop) if self.vmm else 2 << 20
        self._allocs: dict[str, _Allocation] = {}
        self._lock = threading.Lock()
        self._cudart: ctypes.CDLL | None = None
        #: Chunk digests of verified layouts, the residency's (Note [chunk digests]).
        self.pool: ChunkDigests | None = None

    def names(self) -> tuple[str, ...]:
        """The names an acquire may give for this device: its UUID and its ordinal."""
        return (self.uuid, str(self.ordinal))

    def load(
        self,
        digest: str,
        source: Path,
        size: int,
        label: str,
        progress: Progress | None = None,
        verified: Stamp | None = None,
    ) -> Loaded:
        """Blocking: hash the disk layout (always: Note [trusted re-loads] in
        :mod:`trims.daemon.residency`) and copy it into device memory."""
        with self._lock:
            if digest in self._allocs:
                return Loaded(None, 0)
            self.driver.set_context(self._ctx)
            view = _host_view(source, size, digest, label, self.pool)
            try:
                host = ctypes.c_char.from_buffer(view)
                try:
                    alloc = self._load_vmm(host, size) if self.vmm else self._load_ipc(host, size)
                finally:
                    del host
                if progress is not None:
                    progress("load", size, size)
            finally:
                view.close()
            self._allocs[digest] = alloc
        log.info(
            "model %s loaded into gpu tier on %s (%d bytes, %s)",
            label,
            self.uuid,
            alloc.alloc_size,
            "vmm fd" if alloc.fd is not None else "cuda ipc",
        )
        return Loaded(None, size)

    def _load_vmm(self, host: ctypes.c_char, size: int) -> _Allocation:
        d = self.driver
        alloc_size = round_up(size, self.granularity)
        handle = ctypes.c_uint64()
        d.call(
            "cuMemCreate",
            ctypes.byref(handle),
            ctypes.c_size_t(alloc_size),
            ctypes.byref(self._prop),
            ctypes.c_uint64(0),
        )
        try:
            ptr = d.map(handle.value, alloc_size, self.device, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            try:
                d.call(
                    "cuMemcpyHtoD_v2",
                    ctypes.c_uint64(ptr),
                    ctypes.byref(host),
                    ctypes.c_size_t(size),
                )
                fd = ctypes.c_int(-1)
                d.call(
                    "cuMemExportToShareableHandle",
                    ctypes.byref(fd),
                    ctypes.c_uint64(handle.value),
                    ctypes.c_int(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                    ctypes.c_uint64(0),
                )
                os.set_inheritable(fd.value, False)
            except BaseException:
                d.unmap(ptr, alloc_size)
                raise
        except BaseException:
            d.lib.cuMemRelease(ctypes.c_uint64(handle.value))
            raise
        return _Allocation(size, alloc_size, handle.value, ptr, fd.value)

    def _runtime(self) -> ctypes.CDLL:
        if self._cudart is None:
            found = ctypes.util.find_library("cudart")
            names = ((found,) if found else ()) + CUDART_NAMES
            self._cudart = load_library(names)
            if self._cudart is None:
                raise Unavailable(
                    f"device {self.uuid} has no POSIX-fd VMM support and libcudart for the "
                    "legacy CUDA IPC path is missing; install the CUDA runtime"
                )
        return self._cudart

    def _rt(self, fn: str, *args: Any) -> None:
        rt = self._runtime()
        code = int(getattr(rt, fn)(*args))
        if code:
            rt.cudaGetErrorString.restype = ctypes.c_char_p
            text = (rt.cudaGetErrorString(code) or b"").decode()
            raise CudaError(f"{fn} failed: error {code} ({text})", call=fn, cuda_error=code)

    def _load_ipc(self, host: ctypes.c_char, size: int) -> _Allocation:
        self._rt("cudaSetDevice", ctypes.c_int(self.ordinal))
        ptr = ctypes.c_void_p()
        alloc_size = round_up(size, self.granularity)
        self._rt("cudaMalloc", ctypes.byref(ptr), ctypes.c_size_t(alloc_size))
        try:
            self._rt(
                "cudaMemcpy",
                ptr,
                ctypes.byref(host),
                ctypes.c_size_t(size),
                ctypes.c_int(CUDA_MEMCPY_HOST_TO_DEVICE),
            )
            ipc = (ctypes.c_ubyte * 64)()
            self._rt("cudaIpcGetMemHandle", ctypes.byref(ipc), ptr)
        except BaseException:
            self._runtime().cudaFree(ptr)
            raise
        return _Allocation(size, alloc_size, 0, int(ptr.value or 0), None, bytes(ipc).hex())

    def export(self, digest: str) -> Export:
        a = self._allocs[digest]
        if a.fd is not None:
            handle = {
                "kind": "cuda_vmm",
                "device_uuid": self.uuid,
                "size": a.size,
                "alloc_size": a.alloc_size,
            }
            return Export(handle, a.fd)
        handle = {
            "kind": "cuda_ipc",
            "device_uuid": self.uuid,
            "ipc_handle": a.ipc_handle,
            "size": a.size,
        }
        return Export(handle, None)

    def free(self, digest: str) -> None:
        with self._lock:
            a = self._allocs.pop(digest)
            self.driver.set_context(self._ctx)
            if a.fd is None:
                self._runtime().cudaFree(ctypes.c_void_p(a.ptr))
                return
            os.close(a.fd)
            self.driver.unmap(a.ptr, a.alloc_size)
            self.driver.call("cuMemRelease", ctypes.c_uint64(a.handle))

    def close(self) -> None:
        for digest in list(self._allocs):
            self.free(digest)


def open_gpu_tier(budget: int, ordinal: int = 0) -> GpuTier | None:
    """The GPU tier when a budget is set and CUDA works; None (tier off) otherwise."""
    if budget <= 0:
        return None
    try:
        return GpuTier(CudaDriver.open(), ordinal)
    except TrimsError as e:
        log.warning("gpu tier is off: %s (gpu budget %d bytes ignored)", e.message, budget)
        return None
