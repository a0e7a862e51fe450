"""GPU tier: exported device memory imported by another process (needs a CUDA device).

Every path checks the bytes: the importer copies the whole buffer back with the driver API and
compares it with the manifest's sha256 and with the array it came from. The daemon exports CUDA
VMM memory as a POSIX fd where the device can; the legacy ``cuda_ipc`` export (the fallback)
is forced in its own test, since a VMM-capable device would never take it.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.daemon.rawclient import RawClient
from tests.fixtures.store import DaemonProcess, layout_bytes
from trims.errors import TrimsError, Unavailable
from trims.layout import Manifest


def _cuda_driver() -> object | None:
    from trims.cuda import CudaDriver

    try:
        return CudaDriver.open()
    except TrimsError:
        return None


HAVE_CUDA = _cuda_driver() is not None
needs_cuda = pytest.mark.skipif(
    not HAVE_CUDA, reason="no CUDA driver or device on this machine (libcuda.so.1 with a GPU)"
)
W = np.arange(1 << 20, dtype=np.float32)


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def _check_bytes(host: bytes, manifest: Manifest) -> None:
    assert hashlib.sha256(host).hexdigest() == manifest.digest
    (w,) = manifest.tensors
    got = np.frombuffer(host, np.float32, W.size, w.offset)
    assert np.array_equal(got, W)


def _read_back(
    driver: Any, device: int, handle: dict[str, Any], fds: list[int], size: int
) -> bytes:
    """Import the daemon's export in this process, copy ``size`` bytes to the host, undo it."""
    from trims.cuda import CU_MEM_ACCESS_FLAGS_PROT_READ, CU_MEM_ACCESS_FLAGS_PROT_READWRITE

    host = ctypes.create_string_buffer(size)
    if handle["kind"] == "cuda_ipc":
        assert fds == [] and len(handle["ipc_handle"]) == 128
        ptr = ctypes.c_uint64()
        raw = _IpcHandle(bytes.fromhex(handle["ipc_handle"]))
        driver.call("cuIpcOpenMemHandle_v2", ctypes.byref(ptr), raw, ctypes.c_uint(1))
        try:
            driver.copy_to_host(host, ptr.value, size)
        finally:
            driver.call("cuIpcCloseMemHandle", ctypes.c_uint64(ptr.value))
        return host.raw
    assert handle["kind"] == "cuda_vmm" and len(fds) == 1
    alloc = driver.import_fd(fds[0])
    os.close(fds[0])
    try:  # read-only where the driver allows it
        ptr_v = driver.map(alloc, handle["alloc_size"], device, CU_MEM_ACCESS_FLAGS_PROT_READ)
    except TrimsError:
        ptr_v = driver.map(alloc, handle["alloc_size"], device, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    try:
        driver.copy_to_host(host, ptr_v, size)
    finally:
        driver.unmap(ptr_v, handle["alloc_size"])
        driver.call("cuMemRelease", ctypes.c_uint64(alloc))
    return host.raw


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
def test_gpu_tier_exports_device_memory_another_process_reads(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    from trims.cuda import CudaDriver

    daemon = start_daemon(models={"m": {"w": W}}, gpu_budget="1GiB")
    driver = CudaDriver.open()
    device = driver.device(0)
    driver.set_context(driver.primary_context(device))
    with RawClient(daemon.socket) as client:
        result, fds = client.call("acquire", name="m", tier="gpu", device=driver.uuid(device))
        handle = result["handle"]
        assert handle["device_uuid"] == driver.uuid(device)
        manifest = Manifest.from_dict(result["manifest"])
        host = _read_back(driver, device, handle, fds, manifest.total_bytes)
        _check_bytes(host, manifest)
        stats = client.result("stats")["tiers"]["gpu"]
        assert stats["models"] == 1 and stats["used"] == W.nbytes
        client.result("release", lease=result["lease"])
    with RawClient(daemon.admin_socket) as admin:
        assert admin.result("evict", name="m", tier="gpu")["evicted"] == ["gpu"]


IMPORTER = textwrap.dedent(
    """
    import ctypes, hashlib, json, sys
    from trims.layout import Manifest
    from trims.runtime.adapters.cuda import DeviceMapping

    doc = json.loads(sys.stdin.read())
    manifest = Manifest.from_dict(doc["manifest"])
    mapping = DeviceMapping.import_handle(doc["handle"], [], manifest)
    host = ctypes.create_string_buffer(manifest.total_bytes)
    try:
        rc = ctypes.CDLL("libcuda.so.1").cuMemcpyDtoH_v2(
            host, ctypes.c_uint64(mapping.pointer), ctypes.c_size_t(manifest.total_bytes)
        )
    finally:
        mapping.close()
    assert rc == 0, f"cuMemcpyDtoH failed with CUresult {rc}"
    print(json.dumps({"kind": mapping.kind, "sha256": hashlib.sha256(host.raw).hexdigest()}))
    """
)


EXPORTER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from trims.cuda import CudaDriver
    from trims.daemon.tiers.gpu import GpuTier

    blob, digest, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tier = GpuTier(CudaDriver.open())
    tier.vmm = False  # the fallback a device without POSIX-fd VMM handles gets
    tier.load(digest, Path(blob), size, "m")
    export = tier.export(digest)
    print(json.dumps({"handle": export.handle, "fd": export.fd}), flush=True)
    sys.stdin.read()
    tier.close()
    """
)


@pytest.mark.gpu
@needs_cuda
def test_legacy_cuda_ipc_export_is_read_by_another_process(tmp_path: Path) -> None:
    """The fallback: the tier's cudaMalloc + cudaIpcGetMemHandle in one process, the runtime
    adapter's import in another (CUDA IPC refuses a handle opened by the process that made it)."""
    manifest, data = layout_bytes("m", {"w": W})
    blob = tmp_path / "layout.bin"
    blob.write_bytes(data)
    exporter = subprocess.Popen(
        [sys.executable, "-c", EXPORTER, str(blob), manifest.digest, str(manifest.total_bytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert exporter.stdout is not None
        line = exporter.stdout.readline()
        assert line, exporter.stderr.read() if exporter.stderr else ""
        export = json.loads(line)
        assert export["handle"]["kind"] == "cuda_ipc" and export["fd"] is None
        doc = json.dumps({"handle": export["handle"], "manifest": manifest.to_dict()})
        proc = subprocess.run(
            [sys.executable, "-c", IMPORTER],
            input=doc,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == {"kind": "cuda_ipc", "sha256": manifest.digest}
    finally:
        exporter.communicate(timeout=60)
    assert exporter.returncode == 0


def test_the_host_view_a_gpu_load_copies_from_is_checked_by_chunk_digests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs without a GPU: the hash before the copy to the device (Note [chunk digests])."""
    from tests.daemon.layouts import committed_blob
    from trims.daemon.tiers import chunks
    from trims.daemon.tiers.gpu import _host_view
    from trims.errors import CorruptModel

    monkeypatch.setattr(chunks, "CHUNK", 12288)
    path, manifest = committed_blob(tmp_path / "disk", np.arange(10240, dtype=np.float32))
    size = manifest.total_bytes
    pool = chunks.ChunkDigests(workers=2)
    try:
        for _ in range(2):  # hashed whole, then by the chunk digests kept the first time
            view = _host_view(path, size, manifest.digest, "m", pool)
            assert view[:size] == path.read_bytes()
            view.close()
            assert pool.get(manifest.digest, size) is not None
        path.chmod(0o644)
        with open(path, "r+b") as f:
            f.write(b"\x01")
        with pytest.raises(CorruptModel, match="fails its digest check"):
            _host_view(path, size, manifest.digest, "m", pool)
    finally:
        pool.close()
