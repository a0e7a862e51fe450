"""The CUDA driver API through ctypes: the one binding both sides use.

The daemon's GPU tier allocates, maps and exports device memory with it
(:mod:`trims.daemon.tiers.gpu`); the runtime imports that memory and opens CUDA IPC handles with
it (:mod:`trims.runtime.adapters.cuda`). No CUDA Python package is needed: ``libcuda.so.1`` is
loaded when a :class:`CudaDriver` is opened, never at import. Every ``CUresult`` other than
success becomes a :class:`CudaError` naming the call and the CUDA error
(:class:`~trims.errors.ResourceExhausted` for out of memory); callers that know what the user
should do instead wrap it in their own message.
"""

from __future__ import annotations

import ctypes
from typing import Any

from trims.errors import ResourceExhausted, TrimsError, Unavailable, ValidationError

__all__ = [
    "CUDA_ERROR_OUT_OF_MEMORY",
    "CUDA_MEMCPY_HOST_TO_DEVICE",
    "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
    "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
    "CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS",
    "CU_MEM_ACCESS_FLAGS_PROT_READ",
    "CU_MEM_ACCESS_FLAGS_PROT_READWRITE",
    "CU_MEM_ALLOCATION_TYPE_PINNED",
    "CU_MEM_ALLOC_GRANULARITY_MINIMUM",
    "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
    "CU_MEM_LOCATION_TYPE_DEVICE",
    "CUipcMemHandle",
    "CUmemAccessDesc",
    "CUmemAllocFlags",
    "CUmemAllocationProp",
    "CUmemLocation",
    "CudaDriver",
    "CudaError",
    "load_library",
]

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CU_MEM_ACCESS_FLAGS_PROT_READ = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_MEMCPY_HOST_TO_DEVICE = 1
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemAllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", CUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", CUmemAllocFlags),
    ]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


class CUipcMemHandle(ctypes.Structure):
    """``CUipcMemHandle`` / ``cudaIpcMemHandle_t``: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_char * 64)]


class CudaError(TrimsError):
    """A CUDA call failed; ``details`` carry the call and the CUresult."""

    code = "cuda"


def load_library(names: tuple[str, ...]) -> ctypes.CDLL | None:
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


class CudaDriver:
    """The few driver-API calls trims needs, each checked (CUresult -> TrimsError)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    @classmethod
    def open(cls) -> CudaDriver:
        """Load libcuda and cuInit; Unavailable when there is no driver or no device."""
        lib = load_library(("libcuda.so.1", "libcuda.so"))
        if lib is None:
            raise Unavailable("no CUDA driver (libcuda.so.1) on this node")
        driver = cls(lib)
        driver.call("cuInit", ctypes.c_uint(0))
        count = ctypes.c_int()
        driver.call("cuDeviceGetCount", ctypes.byref(count))
        if count.value == 0:
            raise Unavailable("the CUDA driver sees no device")
        return driver

    def error_text(self, code: int) -> str:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self.lib.cuGetErrorName(code, ctypes.byref(name))
        self.lib.cuGetErrorString(code, ctypes.byref(text))
        return f"{(name.value or b'CUDA_ERROR').decode()} ({(text.value or b'').decode()})"

    def call(self, fn: str, *args: Any) -> None:
        code = int(getattr(self.lib, fn)(*args))
        if code == 0:
            return
        text = self.error_text(code)
        if code == CUDA_ERROR_OUT_OF_MEMORY:
            raise ResourceExhausted(
                f"{fn} failed: {text}; the device is full: lower --gpu-budget or free memory",
                call=fn,
                cuda_error=code,
            )
        raise CudaError(f"{fn} failed: {text}", call=fn, cuda_error=code)

    def device(self, ordinal: int) -> int:
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        return dev.value

    def attribute(self, attr: int, device: int) -> int:
        value = ctypes.c_int()
        self.call(
            "cuDeviceGetAttribute", ctypes.byref(value), ctypes.c_int(attr), ctypes.c_int(device)
        )
        return value.value

    def uuid(self, device: int) -> str:
        """The device's UUID ("GPU-xxxxxxxx-..."; a MIG instance's own where the driver has
        ``cuDeviceGetUuid_v2``), as the exporter and every importer name it."""
        raw = (ctypes.c_ubyte * 16)()
        fn = "cuDeviceGetUuid_v2" if hasattr(self.lib, "cuDeviceGetUuid_v2") else "cuDeviceGetUuid"
        self.call(fn, ctypes.byref(raw), ctypes.c_int(device))
        h = bytes(raw).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    def primary_context(self, device: int) -> ctypes.c_void_p:
        ctx = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), ctypes.c_int(device))
        return ctx

    def set_context(self, ctx: ctypes.c_void_p) -> None:
        self.call("cuCtxSetCurrent", ctx)

    def allocation_prop(self, device: int) -> CUmemAllocationProp:
        prop = CUmemAllocationProp()
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop.location = CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, device)
        return prop

    def granularity(self, prop: CUmemAllocationProp) -> int:
        gran = ctypes.c_size_t()
        self.call(
            "cuMemGetAllocationGranularity",
            ctypes.byref(gran),
            ctypes.byref(prop),
            ctypes.c_int(CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        )
        return gran.value

    def map(self, handle: int, size: int, device: int, flags: int) -> int:
        """Reserve a VA range, map ``handle`` there and grant ``device`` ``flags`` access."""
        ptr = ctypes.c_uint64()
        self.call(
            "cuMemAddressReserve",
            ctypes.byref(ptr),
            ctypes.c_size_t(size),
            ctypes.c_size_t(0),
            ctypes.c_uint64(0),
            ctypes.c_uint64(0),
        )
        try:
            self.call(
                "cuMemMap",
                ctypes.c_uint64(ptr.value),
                ctypes.c_size_t(size),
                ctypes.c_size_t(0),
                ctypes.c_uint64(handle),
                ctypes.c_uint64(0),
            )
            try:
                desc = CUmemAccessDesc(CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, device), flags)
                self.call(
                    "cuMemSetAccess",
                    ctypes.c_uint64(ptr.value),
                    ctypes.c_size_t(size),
                    ctypes.byref(desc),
                    ctypes.c_size_t(1),
                )
            except BaseException:
                self.lib.cuMemUnmap(ctypes.c_uint64(ptr.value), ctypes.c_size_t(size))
                raise
        except BaseException:
            self.lib.cuMemAddressFree(ctypes.c_uint64(ptr.value), ctypes.c_size_t(size))
            raise
        return ptr.value

    def unmap(self, ptr: int, size: int) -> None:
        self.call("cuMemUnmap", ctypes.c_uint64(ptr), ctypes.c_size_t(size))
        self.call("cuMemAddressFree", ctypes.c_uint64(ptr), ctypes.c_size_t(size))

    def import_fd(self, fd: int) -> int:
        """The allocation handle of an exported POSIX fd (the importer's side, used in tests)."""
        handle = ctypes.c_uint64()
        self.call(
            "cuMemImportFromShareableHandle",
            ctypes.byref(handle),
            ctypes.c_void_p(fd),
            ctypes.c_int(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
        )
        return handle.value

    def copy_to_host(self, dst: Any, ptr: int, size: int) -> None:
        self.call("cuMemcpyDtoH_v2", dst, ctypes.c_uint64(ptr), ctypes.c_size_t(size))

    def device_count(self) -> int:
        count = ctypes.c_int()
        self.call("cuDeviceGetCount", ctypes.byref(count))
        return count.value

    def device_by_uuid(self, uuid: str) -> tuple[int, int]:
        """(CUdevice, ordinal) of the device whose UUID is ``uuid`` (or whose ordinal it is)."""
        for ordinal in range(self.device_count()):
            device = self.device(ordinal)
            if self.uuid(device) == uuid or uuid == str(ordinal):
                return device, ordinal
        raise ValidationError(
            f"no CUDA device with UUID {uuid} in this process; check CUDA_VISIBLE_DEVICES"
        )

    def device_by_ordinal(self, ordinal: int) -> int:
        """The CUdevice of device ``ordinal`` as this process numbers them."""
        count = self.device_count()
        if not 0 <= ordinal < count:
            raise ValidationError(
                f"no CUDA device {ordinal} in this process: it sees {count}; check "
                "CUDA_VISIBLE_DEVICES"
            )
        return self.device(ordinal)

    def release_primary_context(self, device: int) -> None:
        self.call("cuDevicePrimaryCtxRelease_v2", ctypes.c_int(device))

    def release(self, handle: int) -> None:
        """Release an allocation handle (cuMemCreate's or an import's)."""
        self.call("cuMemRelease", ctypes.c_uint64(handle))

    def ipc_open(self, raw: bytes) -> int:
        """Open another process's CUDA IPC handle (64 bytes) in the current context."""
        if len(raw) != 64:
            raise ValidationError(
                f"a CUDA IPC handle is 64 bytes (cudaIpcMemHandle_t), got {len(raw)}"
            )
        ptr = ctypes.c_uint64()
        self.call(
            "cuIpcOpenMemHandle_v2", ctypes.byref(ptr), CUipcMemHandle(raw),
            ctypes.c_uint(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
        )  # fmt: skip
        return ptr.value

    def ipc_close(self, ptr: int) -> None:
        self.call("cuIpcCloseMemHandle", ctypes.c_uint64(ptr))

    def copy_from_host(self, ptr: int, src: Any, size: int) -> None:
        self.call("cuMemcpyHtoD_v2", ctypes.c_uint64(ptr), src, ctypes.c_size_t(size))
