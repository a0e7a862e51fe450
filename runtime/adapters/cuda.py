"""Importing a GPU-tier model buffer: CUDA VMM POSIX-fd handles, legacy CUDA IPC as fallback.

Pairs with the daemon's GPU tier, which exports one device allocation per model version. Talks
to the CUDA driver through the one binding both sides share (:mod:`trims.cuda`)::

    cuda_vmm: fd ─cuMemImportFromShareableHandle─▶ handle ─cuMemMap─▶ reserved VA range
              access set read-only where the driver allows (read-write otherwise)
    cuda_ipc: ipc handle ─cuIpcOpenMemHandle─▶ device pointer

:meth:`DeviceMapping.close` undoes exactly what the import did, in reverse order.
:class:`IpcBuffer` opens a client's CUDA IPC handle for the gateway's CUDA shared-memory
extension and copies in and out of it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Iterator
from typing import Any

from trims.cuda import (
    CU_MEM_ACCESS_FLAGS_PROT_READ,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    CudaDriver,
    CudaError,
)
from trims.errors import ProtocolError, Unavailable, ValidationError
from trims.layout import Manifest

log = logging.getLogger(__name__)

#: What a GPU-tier import was doing, and what to do instead, when the driver fails.
_IMPORTING = ("importing a GPU-tier model", "acquire with tier='cpu'")
_OPENING = ("opening a CUDA shared-memory region", "send the tensors")


@contextlib.contextmanager
def _driver_errors(doing: tuple[str, str]) -> Iterator[None]:
    """CUDA failures as Unavailable, saying what failed and what to do instead."""
    try:
        yield
    except CudaError as e:
        raise Unavailable(
            f"CUDA {e.message} while {doing[0]}; {doing[1]} or check the GPU with nvidia-smi"
        ) from e


def _open_driver(doing: tuple[str, str]) -> CudaDriver:
    try:
        with _driver_errors(doing):
            return CudaDriver.open()
    except Unavailable as e:
        if "CUDA " in e.message and " while " in e.message:
            raise
        raise Unavailable(
            f"this process cannot use the CUDA driver for {doing[0]} ({e.message}); run on a "
            f"GPU node or {doing[1]}"
        ) from e


class DeviceMapping:
    """A model buffer in device memory, imported from the daemon's export."""

    def __init__(
        self,
        driver: CudaDriver,
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
            driver = _open_driver(_IMPORTING)
            with _driver_errors(_IMPORTING):
                device, index = driver.device_by_uuid(str(handle.get("device_uuid", "")))
                driver.set_context(driver.primary_context(device))
                if handle.get("kind") == "cuda_vmm":
                    if len(fds) != 1:
                        raise ProtocolError(
                            "a cuda_vmm handle must come with exactly one descriptor"
                        )
                    return cls._import_vmm(driver, device, index, fds[0], size, handle)
                return cls._import_ipc(driver, device, index, size, handle)
        finally:
            for fd in fds:
                os.close(fd)

    @classmethod
    def _import_vmm(
        cls,
        driver: CudaDriver,
        device: int,
        index: int,
        fd: int,
        size: int,
        handle: dict[str, Any],
    ) -> DeviceMapping:
        alloc = int(handle.get("alloc_size", size))
        mem = driver.import_fd(fd)
        try:
            try:
                ptr = driver.map(mem, alloc, device, CU_MEM_ACCESS_FLAGS_PROT_READ)
            except CudaError:
                log.info("device %d refuses read-only imported memory; mapping it read-write",
                         index)  # fmt: skip
                ptr = driver.map(mem, alloc, device, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        except BaseException:
            driver.release(mem)
            raise
        return cls(driver, "cuda_vmm", device, index, ptr, size, alloc, mem)

    @classmethod
    def _import_ipc(
        cls, driver: CudaDriver, device: int, index: int, size: int, handle: dict[str, Any]
    ) -> DeviceMapping:
        try:
            raw = bytes.fromhex(str(handle.get("ipc_handle", "")))
        except ValueError as e:
            raise ProtocolError("cuda_ipc handle is not hex") from e
        if len(raw) != 64:
            raise ProtocolError(f"cuda_ipc handle must be 64 bytes, got {len(raw)}")
        ptr = driver.ipc_open(raw)
        return cls(driver, "cuda_ipc", device, index, ptr, size, size, None)

    def close(self) -> None:
        """Unmap and release what the import created; device tensors over it become invalid."""
        if self._closed:
            return
        self._closed = True
        d = self._driver
        with _driver_errors(_IMPORTING):
            if self.kind == "cuda_vmm":
                d.unmap(self.pointer, self._alloc_size)
                d.release(self._mem_handle or 0)
            else:
                d.ipc_close(self.pointer)
            d.release_primary_context(self._device)


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
        self._driver = d = _open_driver(_OPENING)
        with _driver_errors(_OPENING):
            self._device = d.device_by_ordinal(device_index)
            self._ctx = d.primary_context(self._device)
            try:
                d.set_context(self._ctx)
                self.pointer = d.ipc_open(raw_handle)
            except BaseException:
                d.release_primary_context(self._device)
                raise
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
        with _driver_errors(_OPENING):
            self._driver.set_context(self._ctx)
            self._driver.copy_to_host(out, self.pointer + offset, size)
        return out.raw

    def write(self, offset: int, data: bytes) -> None:
        """Copy ``data`` to ``offset``."""
        self._bounds(offset, len(data))
        with _driver_errors(_OPENING):
            self._driver.set_context(self._ctx)
            self._driver.copy_from_host(self.pointer + offset, data, len(data))

    def close(self) -> None:
        """Close the IPC mapping and release the context (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with _driver_errors(_OPENING):
            self._driver.set_context(self._ctx)
            self._driver.ipc_close(self.pointer)
            self._driver.release_primary_context(self._device)
