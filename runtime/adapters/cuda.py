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


class _Driver:
    """The few driver calls we use, each checked."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise Unavailable(
                "this process cannot load the CUDA driver (libcuda.so.1) to import a GPU-tier "
                "model; run on a GPU node or acquire with tier='cpu'"
            ) from e
        self.check("cuInit", 0)

    def check(self, fn: str, *args: Any) -> None:
        rc = getattr(self.lib, fn)(*args)
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise Unavailable(
                f"CUDA {fn} failed with {(name.value or b'?').decode()} ({rc}) while importing a "
                "GPU-tier model; acquire with tier='cpu' or check the GPU with nvidia-smi"
            )

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
