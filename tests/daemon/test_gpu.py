"""GPU tier: exported CUDA VMM memory imported by another process (needs a CUDA device)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

import numpy as np
import pytest

from tests.daemon.rawclient import RawClient
from tests.fixtures.store import DaemonProcess
from trims.errors import TrimsError, Unavailable


def _cuda_driver() -> object | None:
    from trims.daemon.tiers.gpu import CudaDriver

    try:
        return CudaDriver.open()
    except TrimsError:
        return None


HAVE_CUDA = _cuda_driver() is not None
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA driver or device on this machine")
W = np.arange(1 << 20, dtype=np.float32)


def test_gpu_acquire_without_cuda_is_a_clear_error(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    if HAVE_CUDA:
        pytest.skip("this machine has CUDA; the gpu tier is on")
    daemon = start_daemon(models={"m": {"w": W}}, gpu_budget="1GiB")
    with RawClient(daemon.socket) as client:
        with pytest.raises(Unavailable, match="no CUDA device"):
            client.call("acquire", name="m", tier="gpu")
        assert client.result("stats")["tiers"]["gpu"]["available"] is False


@pytest.mark.gpu
@needs_cuda
def test_gpu_tier_exports_vmm_memory_another_process_reads(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    from trims.daemon.tiers.gpu import (
        CU_MEM_ACCESS_FLAGS_PROT_READ,
        CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        CudaDriver,
    )

    daemon = start_daemon(models={"m": {"w": W}}, gpu_budget="1GiB")
    driver = CudaDriver.open()
    device = driver.device(0)
    ctx = driver.primary_context(device)
    driver.set_context(ctx)
    with RawClient(daemon.socket) as client:
        result, fds = client.call("acquire", name="m", tier="gpu", device=driver.uuid(device))
        handle = result["handle"]
        assert handle["device_uuid"] == driver.uuid(device)
        if handle["kind"] == "cuda_ipc":
            assert fds == [] and len(handle["ipc_handle"]) == 128
            return
        assert handle["kind"] == "cuda_vmm" and len(fds) == 1
        alloc = driver.import_fd(fds[0])
        os.close(fds[0])
        try:  # read-only where the driver allows it
            ptr = driver.map(alloc, handle["alloc_size"], device, CU_MEM_ACCESS_FLAGS_PROT_READ)
        except TrimsError:
            ptr = driver.map(
                alloc, handle["alloc_size"], device, CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            )
        out = np.empty_like(W)
        driver.copy_to_host(out.ctypes.data_as(ctypes.c_void_p), ptr, W.nbytes)
        driver.unmap(ptr, handle["alloc_size"])
        driver.call("cuMemRelease", ctypes.c_uint64(alloc))
        assert np.array_equal(out, W)
        stats = client.result("stats")["tiers"]["gpu"]
        assert stats["models"] == 1 and stats["used"] == W.nbytes
        client.result("release", lease=result["lease"])
    with RawClient(daemon.admin_socket) as admin:
        assert admin.result("evict", name="m", tier="gpu")["evicted"] == ["gpu"]
