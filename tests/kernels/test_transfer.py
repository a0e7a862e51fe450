"""The transfer study at tiny sizes: every modality reports sane numbers; IPC delivers bytes."""

from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest

from trims.kernels import transfer
from trims.kernels import transfer_ipc as ipc


def test_tiny_run_reports_every_modality() -> None:
    settings = transfer.TransferSettings(min_log2=8, max_log2=10, repeat=2, budget_s=0.1)
    rows = transfer.run(settings)
    seen = {(r.domain, r.modality, r.cache) for r in rows}
    for cache in ("warm", "flushed"):
        assert ("host", "copy", cache) in seen and ("host", "copy-first-touch", cache) in seen
    for name in ("memfd-create-write-seal", "memfd-map", "memfd-map-populate", "pipe",
                 "unix-socket", "file-read"):  # fmt: skip
        assert ("ipc", name, "warm") in seen
    assert {r.size for r in rows} == {256, 512, 1024}
    for r in rows:
        assert r.seconds > 0 and r.bandwidth == pytest.approx(r.size / r.seconds)


@pytest.mark.parametrize("size", [1, 7, 4096, 100_003])
def test_every_ipc_modality_delivers_the_bytes(size: int) -> None:
    payload = np.random.default_rng(size).integers(0, 255, size, np.uint8)
    view = memoryview(payload.data)
    expected = ipc.checksum(view)
    with ipc.Consumer.start() as consumer:
        for op in (ipc.OP_MEMFD, ipc.OP_MEMFD_POPULATE, ipc.OP_PIPE, ipc.OP_SOCKET, ipc.OP_FILE):
            assert consumer.transfer(op, view, expected) > 0


def test_checksum_reads_every_byte() -> None:
    a = bytearray(19)
    base = ipc.checksum(a)
    for i in range(19):
        b = bytearray(a)
        b[i] = 1
        assert ipc.checksum(b) != base


def test_memfd_is_sealed_against_writes() -> None:
    fd = ipc.build_memfd(memoryview(b"weights"))
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_WRITE and seals & fcntl.F_SEAL_GROW
        with pytest.raises(PermissionError):
            os.write(fd, b"x")
    finally:
        os.close(fd)


def test_gpu_modalities_need_cuda() -> None:
    from trims.errors import RequestError
    from trims.kernels.gpu import cupy_available

    if cupy_available():
        pytest.skip("CUDA is present: the GPU path is covered by test_gpu.py")
    with pytest.raises(RequestError, match="CuPy/CUDA not available"):
        transfer.run(transfer.TransferSettings(max_log2=8, host=False, ipc=False, gpu=True))
