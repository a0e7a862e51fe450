"""Importing a GPU-tier model buffer: CUDA VMM POSIX-fd handles, legacy CUDA IPC as fallback.

Pairs with the daemon's GPU tier, which exports one device allocation per model version.
Talks to the CUDA driver (``libcuda.so.1``) through ctypes so no CUDA Python package is needed::

    cuda_vmm: fd ─cuMemImportFromShareableHandle─▶ handle ─cuMemMap─▶ reserved VA range
              access set read-only where the driver allows (read-write otherwise)
    cuda_ipc: ipc handle ─cuIpcOpenMemHandle─▶ device pointer

:meth:`DeviceMapping.close` undoes exactly what the import did, in reverse order.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

from trims.errors import ProtocolError, Unavailable, ValidationError
from trims.layout import Manifest

log = logging.getLogger(__name__)

CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READ = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


#: What a GPU-tier import says it was doing, and what to do instead, when the driver fails.
_IMPORTING = ("importing a GPU-tier model", "acquire with tier='cpu'")


class _Driver:
    """The few driver calls we use, each checked; ``doing`` = (what this is for, what to do
    instead) for the messages."""

    def __init__(self, doing: tuple[str, str] = _IMPORTING) -> None:
        self.doing = doing
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise Unavailable(
                f"this process cannot load the CUDA driver (libcuda.so.1) for {doing[0]}; run "
                f"on a GPU node or {doing[1]}"
            ) from e
        self.check("cuInit", 0)

    def check(self, fn: str, *args: Any) -> None:
        rc = getattr(self.lib, fn)(*args)
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise Unavailable(
                f"CUDA {fn} failed with {(name.value or b'?').decode()} ({rc}) while "
                f"{self.doing[0]}; {self.doing[1]} or check the GPU with nvidia-smi"
            )

    def device_by_index(self, index: int) -> int:
        """The CUdevice of device ``index`` (as this process numbers them)."""
        count = ctypes.c_int()
        self.check("cuDeviceGetCount", ctypes.byref(count))
        if not 0 <= index < count.value:
            raise ValidationError(
                f"no CUDA device {index} in this process: it sees {count.value}; check "
                "CUDA_VISIBLE_DEVICES"
            )
        dev = ctypes.c_int()
        self.check("cuDeviceGet", ctypes.byref(dev), index)
        return dev.value

    def device_by_uuid(self, uuid: str) -> tuple[int, int]:
        """(CUdevice, index) of the device whose UUID is ``uuid`` ("GPU-xxxxxxxx-...")."""
        count = ctypes.c_int()
        self.check("cuDeviceGetCount", ctypes.byref(count))
        for index in range(count.value):
            dev = ctypes.c_int()
            self.check("cuDeviceGet", ctypes.byref(dev), index)
            raw = (ctypes.c_ubyte * 16)()
            self.check("cuDeviceGetUuid_v2", raw, dev)
            h = bytes(raw).hex()
            text = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
            if text == uuid or uuid == str(index):
                return dev.value, index
        raise ValidationError(
            f"no CUDA device with UUID {uuid} in this process; check CUDA_VISIBLE_DEVICES"
        )


class DeviceMapping:
    """A model buffer in device memory, imported from the daemon's export."""

    def __init__(
        self,
        driver: _Driver,
        kind: str,
        device: int,
        device_index: int,
        pointer: int,
        size: int,
        alloc_size: int,
        mem_handle: int | None,
    ) -> None:
        self._driver = driver
        self.kind = kind
        self._device = device
        self.device_index = device_index
        self.pointer = pointer
        self.size = size
        self._alloc_size = alloc_size
        self._mem_handle = mem_handle
        self._closed = False

    @classmethod
    def import_handle(
        cls, handle: dict[str, Any], fds: list[int], manifest: Manifest
    ) -> DeviceMapping:
        """Import a ``cuda_vmm`` (one fd, closed here) or ``cuda_ipc`` handle."""
        try:
            size = int(handle.get("size", 0))
            if manifest.total_bytes > size:
                raise ValidationError(
                    f"model {manifest.name}: manifest describes {manifest.total_bytes} bytes but "
                    f"the device allocation holds {size}; re-load it into the gpu tier"
                )
            driver = _Driver()
            device, index = driver.device_by_uuid(str(handle.get("device_uuid", "")))
            ctx = ctypes.c_void_p()
            driver.check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), device)
            driver.check("cuCtxSetCurrent", ctx)
            if handle.get("kind") == "cuda_vmm":
                if len(fds) != 1:
                    raise ProtocolError("a cuda_vmm handle must come with exactly one descriptor")
                return cls._import_vmm(driver, device, index, fds[0], size, handle)
            return cls._import_ipc(driver, device, index, size, handle)
        finally:
            for fd in fds:
                os.close(fd)

    @classmethod
    def _import_vmm(
        cls, driver: _Driver, device: int, index: int, fd: int, size: int, handle: dict[str, Any]
    ) -> DeviceMapping:
        alloc = int(handle.get("alloc_size", size))
        mem = ctypes.c_ulonglong()
        driver.check(
            "cuMemImportFromShareableHandle",
            ctypes.byref(mem),
            ctypes.c_void_p(fd),
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
        ptr = ctypes.c_ulonglong()
        driver.check("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(alloc), 0, 0, 0)
        driver.check("cuMemMap", ptr, ctypes.c_size_t(alloc), ctypes.c_size_t(0), mem, 0)
        for flags in (CU_MEM_ACCESS_FLAGS_PROT_READ, CU_MEM_ACCESS_FLAGS_PROT_READWRITE):
            desc = _AccessDesc(_Location(CU_MEM_LOCATION_TYPE_DEVICE, device), flags)
            rc = driver.lib.cuMemSetAccess(ptr, ctypes.c_size_t(alloc), ctypes.byref(desc), 1)
            if rc == 0:
                break
            log.info("device %d refuses read-only imported memory; mapping it read-write", index)
        else:
            driver.check("cuMemSetAccess", ptr, ctypes.c_size_t(alloc), ctypes.byref(desc), 1)
        return cls(driver, "cuda_vmm", device, index, ptr.value, size, alloc, mem.value)

    @classmethod
    def _import_ipc(
        cls, driver: _Driver, device: int, index: int, size: int, handle: dict[str, Any]
    ) -> DeviceMapping:
        try:
            raw = bytes.fromhex(str(handle.get("ipc_handle", "")))
        except ValueError as e:
            raise ProtocolError("cuda_ipc handle is not hex") from e
        if len(raw) != 64:
            raise ProtocolError(f"cuda_ipc handle must be 64 bytes, got {len(raw)}")
        ipc = _IpcHandle(raw)
        ptr = ctypes.c_ulonglong()
        driver.check(
            "cuIpcOpenMemHandle_v2", ctypes.byref(ptr), ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        )
        return cls(driver, "cuda_ipc", device, index, ptr.value, size, size, None)

    def close(self) -> None:
        """Unmap and release what the import created; device tensors over it become invalid."""
        if self._closed:
            return
        self._closed = True
        d = self._driver
        if self.kind == "cuda_vmm":
            size = ctypes.c_size_t(self._alloc_size)
            d.check("cuMemUnmap", ctypes.c_ulonglong(self.pointer), size)
            d.check(
                "cuMemAddressFree",
                ctypes.c_ulonglong(self.pointer),
                ctypes.c_size_t(self._alloc_size),
            )
            d.check("cuMemRelease", ctypes.c_ulonglong(self._mem_handle or 0))
        else:
            d.check("cuIpcCloseMemHandle", ctypes.c_ulonglong(self.pointer))
        d.check("cuDevicePrimaryCtxRelease_v2", self._device)


class IpcBuffer:
    """Device memory another process exported with ``cudaIpcGetMemHandle``, opened here
    (what Triton's CUDA shared-memory extension registers); copies in and out of it.

    Every call makes the device's primary context current on the calling thread and leaves
    it current (the gateway calls from its event loop thread only).
    """

    def __init__(self, device_index: int, raw_handle: bytes, size: int) -> None:
        if len(raw_handle) != 64:
            raise ValidationError(
                f"a CUDA IPC handle is 64 bytes (cudaIpcMemHandle_t), got {len(raw_handle)}"
            )
        self._driver = _Driver(("opening a CUDA shared-memory region", "send the tensors"))
        d = self._driver
        self._device = d.device_by_index(device_index)
        self._ctx = ctypes.c_void_p()
        d.check("cuDevicePrimaryCtxRetain", ctypes.byref(self._ctx), self._device)
        try:
            d.check("cuCtxSetCurrent", self._ctx)
            ptr = ctypes.c_ulonglong()
            d.check(
                "cuIpcOpenMemHandle_v2", ctypes.byref(ptr), _IpcHandle(raw_handle),
                CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
            )  # fmt: skip
        except BaseException:
            d.check("cuDevicePrimaryCtxRelease_v2", self._device)
            raise
        self.pointer = ptr.value
        self.size = size
        self.device_index = device_index
        self._closed = False

    def _bounds(self, offset: int, size: int) -> None:
        if self._closed:
            raise ValidationError("the CUDA shared-memory region was unregistered")
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ValidationError(
                f"{size} bytes at offset {offset} run past the region's {self.size} bytes"
            )

    def read(self, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset``, copied to the host."""
        self._bounds(offset, size)
        out = ctypes.create_string_buffer(size)
        d = self._driver
        d.check("cuCtxSetCurrent", self._ctx)
        d.check(
            "cuMemcpyDtoH_v2", out, ctypes.c_ulonglong(self.pointer + offset), ctypes.c_size_t(size)
        )
        return out.raw

    def write(self, offset: int, data: bytes) -> None:
        """Copy ``data`` to ``offset``."""
        self._bounds(offset, len(data))
        d = self._driver
        d.check("cuCtxSetCurrent", self._ctx)
        d.check(
            "cuMemcpyHtoD_v2", ctypes.c_ulonglong(self.pointer + offset), data,
            ctypes.c_size_t(len(data)),
        )  # fmt: skip

    def close(self) -> None:
        """Close the IPC mapping and release the context (idempotent)."""
        if self._closed:
            return
        self._closed = True
        d = self._driver
        d.check("cuCtxSetCurrent", self._ctx)
        d.check("cuIpcCloseMemHandle", ctypes.c_ulonglong(self.pointer))
        d.check("cuDevicePrimaryCtxRelease_v2", self._device)
