"""GPU-tier import (runtime/adapters/cuda.py): the right bytes with a driver, a clear error without.

The GPU-side check needs no framework: the imported device memory is copied back with the CUDA
driver API and compared with the manifest's sha256 and the source arrays, so it runs on any
machine with an NVIDIA driver and device (torch's CUDA tensors over the same import are
tests/runtime/test_client.py's, where a CUDA torch is installed).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from collections.abc import Callable

import numpy as np
import pytest

from tests.fixtures.store import DaemonProcess
from trims.errors import Unavailable
from trims.layout import Manifest
from trims.runtime.adapters.cuda import DeviceMapping
from trims.runtime.client import StoreClient

WEIGHTS = {
    "w": np.arange(300_000, dtype=np.float32) / 7,
    "b": np.arange(-50, 50, dtype=np.int64),
}


def _has_device() -> bool:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int()
    return lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def _has_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(
    _has_driver(),
    reason="a CUDA driver is present: test_gpu_tier_import_reads_the_right_bytes imports for real",
)
def test_without_a_driver_the_import_fails_cleanly() -> None:
    manifest = Manifest("m", "1", "0" * 64, "numpy", 4096, ())
    fd = os.memfd_create("fake-vmm-export", os.MFD_CLOEXEC)
    handle = {"kind": "cuda_vmm", "device_uuid": "GPU-0", "size": 4096, "alloc_size": 4096}
    with pytest.raises(Unavailable, match="tier='cpu'"):
        DeviceMapping.import_handle(handle, [fd], manifest)
    with pytest.raises(OSError):
        os.fstat(fd)


def _copy_back(mapping: DeviceMapping, size: int) -> bytes:
    """The device buffer, copied to the host with cuMemcpyDtoH (the import made its context
    current on this thread)."""
    host = ctypes.create_string_buffer(size)
    rc = ctypes.CDLL("libcuda.so.1").cuMemcpyDtoH_v2(
        host, ctypes.c_uint64(mapping.pointer), ctypes.c_size_t(size)
    )
    assert rc == 0, f"cuMemcpyDtoH failed with CUresult {rc}"
    return host.raw


@pytest.mark.gpu
@pytest.mark.skipif(not _has_device(), reason="no CUDA driver with a device on this machine")
def test_gpu_tier_import_reads_the_right_bytes(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = start_daemon(models={"m": WEIGHTS}, gpu_budget="1GiB")
    with StoreClient(daemon.socket) as client:
        for _ in range(2):  # the second import follows a release that undid the first
            with client.acquire("m", tier="gpu") as lease:
                mapping = lease.device
                assert isinstance(mapping, DeviceMapping)
                assert mapping.kind == lease.handle["kind"] in ("cuda_vmm", "cuda_ipc")
                manifest = lease.manifest
                host = _copy_back(mapping, manifest.total_bytes)
                assert hashlib.sha256(host).hexdigest() == manifest.digest
                for t in manifest.tensors:
                    got = np.frombuffer(host, t.dtype, t.nbytes // WEIGHTS[t.name].itemsize,
                                        t.offset)  # fmt: skip
                    assert np.array_equal(got.reshape(t.shape), WEIGHTS[t.name])
        assert client.stats()["leases"] == 0
