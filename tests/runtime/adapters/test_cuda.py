"""GPU-tier import without a CUDA driver: a clear error and no descriptor left open."""

from __future__ import annotations

import ctypes
import os

import pytest

from trims.errors import Unavailable
from trims.layout import Manifest
from trims.runtime.adapters.cuda import DeviceMapping


def _has_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(
    _has_driver(), reason="a CUDA driver is present: tests/runtime/test_client.py imports for real"
)
def test_without_a_driver_the_import_fails_cleanly() -> None:
    manifest = Manifest("m", "1", "0" * 64, "numpy", 4096, ())
    fd = os.memfd_create("fake-vmm-export", os.MFD_CLOEXEC)
    handle = {"kind": "cuda_vmm", "device_uuid": "GPU-0", "size": 4096, "alloc_size": 4096}
    with pytest.raises(Unavailable, match="tier='cpu'"):
        DeviceMapping.import_handle(handle, [fd], manifest)
    with pytest.raises(OSError):
        os.fstat(fd)
