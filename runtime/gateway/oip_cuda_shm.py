"""Triton's CUDA shared-memory extension: device buffers clients register by CUDA IPC handle.

A client on the gateway's host allocates device memory, exports it (``cudaIpcGetMemHandle``;
what ``tritonclient.utils.cuda_shared_memory`` does) and registers the 64-byte handle under a
region name (``{"raw_handle": {"b64": ...}, "device_id", "byte_size"}``); infer inputs and
outputs then name the region as they name a system shared-memory one
(``shared_memory_region``, ``shared_memory_offset``, ``shared_memory_byte_size``).

The gateway opens the handle once, at registration (``cuIpcOpenMemHandle`` in the device's
primary context, :class:`trims.runtime.adapters.cuda.IpcBuffer`), copies the bytes a request
names device-to-host for an input and host-to-device for an output, and closes the handle at
unregistration and shutdown. Regions belong to the registering caller (its token, or without
one its local user), with the same rules as system shared memory (Note [region owners] in
:mod:`trims.runtime.gateway.oip_shm`): another owner can neither see, use nor unregister them;
an owner holds at most :data:`MAX_REGIONS_PER_OWNER`; offsets and sizes are checked against the
region. A CUDA IPC handle is a capability: whoever holds one may map that memory, so no check
of the memory's owner applies; the routes answer loopback callers only.

On a host without a CUDA driver a registration answers 400 saying so (the status and listing
routes work and list nothing).
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from trims.errors import RequestError, TrimsError
from trims.runtime.gateway.oip_regions import MAX_REGIONS_PER_OWNER, OwnedRegions, fits_output
from trims.runtime.gateway.tensors import ShmRef

__all__ = ["MAX_REGIONS_PER_OWNER", "CudaSharedMemoryRegistry"]

log = logging.getLogger(__name__)


class DeviceBuffer(Protocol):
    """What a registration holds: :class:`trims.runtime.adapters.cuda.IpcBuffer`."""

    def read(self, offset: int, size: int) -> bytes: ...
    def write(self, offset: int, data: bytes) -> None: ...
    def close(self) -> None: ...


#: (device index, 64-byte handle, size) -> an opened buffer.
Opener = Callable[[int, bytes, int], DeviceBuffer]


def _open_ipc(device_id: int, raw: bytes, size: int) -> DeviceBuffer:
    from trims.runtime.adapters.cuda import IpcBuffer

    return IpcBuffer(device_id, raw, size)


@dataclass(eq=False)
class CudaRegion:
    name: str
    device_id: int
    byte_size: int
    buffer: DeviceBuffer

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}

    def close(self) -> None:
        self.buffer.close()


class CudaSharedMemoryRegistry(OwnedRegions[CudaRegion]):
    """The CUDA regions registered on one gateway, by owner and region name."""

    def __init__(
        self, opener: Opener = _open_ipc, max_regions_per_owner: int = MAX_REGIONS_PER_OWNER
    ) -> None:
        super().__init__("CUDA shared-memory", "cudasharedmemory", max_regions_per_owner)
        self._open = opener

    def register(self, owner: str, name: str, doc: Any) -> None:
        """Register ``doc`` (``{"raw_handle": {"b64"}, "device_id", "byte_size"}``)."""
        self._admit(owner, name)
        raw, device_id, byte_size = _parse(doc)
        try:
            buffer = self._open(device_id, raw, byte_size)
        except TrimsError as e:
            raise RequestError(
                f"CUDA shared memory is not available on this gateway: {e.message}; pass "
                "tensors in system shared memory (/v2/systemsharedmemory) or in the body"
            ) from None
        self._add(owner, CudaRegion(name, device_id, byte_size, buffer))
        log.info("CUDA shared-memory region %s registered (device %d, %d bytes)",
                 name, device_id, byte_size)  # fmt: skip

    def read(self, owner: str, ref: ShmRef, what: str) -> bytes:
        region = self._use(owner, ref, what)
        return region.buffer.read(ref.offset, ref.byte_size) if ref.byte_size else b""

    def write(self, owner: str, ref: ShmRef, data: bytes, what: str) -> None:
        fits_output(ref, data, what)
        region = self._use(owner, ref, what)
        if data:
            region.buffer.write(ref.offset, data)


def _parse(doc: Any) -> tuple[bytes, int, int]:
    shape = 'register needs {"raw_handle": {"b64": str}, "device_id": int, "byte_size": int}'
    if not isinstance(doc, dict) or not isinstance(doc.get("raw_handle"), dict):
        raise RequestError(shape)
    b64 = doc["raw_handle"].get("b64")
    if not isinstance(b64, str):
        raise RequestError(shape)
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("raw_handle.b64 is not base64") from None
    if len(raw) != 64:
        raise RequestError(
            f"raw_handle is {len(raw)} bytes; a CUDA IPC handle (cudaIpcMemHandle_t) is 64"
        )
    values = []
    for key in ("device_id", "byte_size"):
        value = doc.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise RequestError(f"'{key}' must be a non-negative integer, got {value!r}")
        values.append(value)
    if values[1] == 0:
        raise RequestError("'byte_size' must be at least 1")
    return raw, values[0], values[1]
