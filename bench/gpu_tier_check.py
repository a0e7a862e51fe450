"""The GPU-tier checks of the GPU check kit, each run in its own processes on a real daemon.

    python bench/gpu_tier_check.py tier  --work DIR --json OUT.json [--model-mb 64]
    python bench/gpu_tier_check.py torch --work DIR --json OUT.json
    python bench/gpu_tier_check.py share --work DIR --json OUT.json [--processes 4]

``tier``: a `trims daemon` on a temp socket with a GPU budget; a model (written as a
safetensors file, added through the admin socket) loaded into its GPU tier; a second process
acquires it with the store client, copies the device memory back with the CUDA driver API and
compares it with the manifest's sha256 and with the NumPy arrays it came from; where the
import is mapped read-only, a write through it must be refused, and a fresh process then finds
the daemon's copy unchanged. The legacy ``cuda_ipc`` path: an exporter process loads the same
layout into a GPU tier with VMM turned off (``cudaMalloc`` + ``cudaIpcGetMemHandle``), and a
reader imports the handle with the runtime's adapter and checks the bytes the same way.

``torch``: ``trims.runtime.adapters.torch.cuda_tensors`` over a GPU-tier lease equal the
arrays (skipped, with the reason, when torch has no CUDA).

``share``: N processes acquire the same GPU-tier model at once and hold it; their acquire
times, and device memory (``nvidia-smi``) before the load, after it and while all N hold it.

Each writes ``{"status", "figures", "detail"}`` to ``--json``; ``bench/gpu_check.py`` runs them
under its time boxes. The internal roles (``read``, ``export-ipc``, ``read-ipc``,
``torch-read``, ``hold``) are the second processes.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_common import start_daemon

MODEL = "gpucheck"
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READ = 1
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "int64": "I64"}


class CheckFailed(Exception):
    """A check found wrong data or a refused operation; the message says which."""


# ---- the model ------------------------------------------------------------------------------


def model_tensors(model_mb: int) -> dict[str, np.ndarray[Any, Any]]:
    """The check's model: deterministic, odd sizes so alignment padding sits between tensors."""
    rng = np.random.default_rng(20261201)
    n = max(1, (model_mb << 20) // 4)
    return {
        "w": rng.standard_normal(n, dtype=np.float32),
        "h": rng.standard_normal(1000).astype(np.float16).reshape(10, 100),
        "i": np.arange(4097, dtype=np.int64) * 7 - 3,
    }


def write_safetensors(path: Path, tensors: dict[str, np.ndarray[Any, Any]]) -> None:
    """A safetensors file (8-byte header length, JSON header, data), written without the
    safetensors package."""
    header: dict[str, Any] = {}
    offset = 0
    for name, a in tensors.items():
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[str(a.dtype)],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())


def verify(host: bytes | bytearray, manifest: Any, model_mb: int) -> None:
    """The buffer matches the manifest's digest and every tensor equals its source array."""
    digest = hashlib.sha256(host).hexdigest()
    if digest != manifest.digest:
        raise CheckFailed(f"device bytes hash to {digest}, the manifest says {manifest.digest}")
    source = model_tensors(model_mb)
    for t in manifest.tensors:
        got = np.frombuffer(
            host, dtype=t.dtype, count=t.nbytes // np.dtype(t.dtype).itemsize, offset=t.offset
        ).reshape(t.shape)
        if not np.array_equal(got, source[t.name]):
            raise CheckFailed(f"tensor {t.name} read from the device differs from its source")


# ---- the CUDA driver, for copying device memory back ------------------------------------------


def libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def cu(lib: ctypes.CDLL, fn: str, *args: Any) -> int:
    """Call a driver function; its CUresult (0 is success)."""
    return int(getattr(lib, fn)(*args))


def cu_check(lib: ctypes.CDLL, fn: str, *args: Any) -> None:
    rc = cu(lib, fn, *args)
    if rc:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(rc, ctypes.byref(name))
        raise CheckFailed(f"{fn} failed with {(name.value or b'?').decode()} ({rc})")


def device_bytes(pointer: int, size: int) -> bytearray:
    """``size`` bytes of device memory at ``pointer`` (the current context's), copied back."""
    lib = libcuda()
    host = bytearray(size)
    buf = (ctypes.c_char * size).from_buffer(host)
    try:
        cu_check(lib, "cuMemcpyDtoH_v2", buf, ctypes.c_uint64(pointer), ctypes.c_size_t(size))
    finally:
        del buf
    return host


def access_flags(pointer: int, device_index: int) -> int:
    """The access this process has to mapped device memory (1 read-only, 3 read-write)."""

    class Location(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    lib = libcuda()
    flags = ctypes.c_ulonglong()
    loc = Location(CU_MEM_LOCATION_TYPE_DEVICE, device_index)
    cu_check(
        lib, "cuMemGetAccess", ctypes.byref(flags), ctypes.byref(loc), ctypes.c_uint64(pointer)
    )
    return flags.value


def try_write(pointer: int) -> tuple[bool, str]:
    """Write 4 bytes through ``pointer``: (refused, what the driver said)."""
    lib = libcuda()
    data = (ctypes.c_char * 4)(b"\xff", b"\xff", b"\xff", b"\xff")
    rc = cu(lib, "cuMemcpyHtoD_v2", ctypes.c_uint64(pointer), data, ctypes.c_size_t(4))
    sync = cu(lib, "cuCtxSynchronize")
    return (rc != 0 or sync != 0), f"cuMemcpyHtoD returned {rc}, cuCtxSynchronize {sync}"


# ---- second processes -----------------------------------------------------------------------


def role_read(args: argparse.Namespace) -> dict[str, Any]:
    """Acquire from the GPU tier, read back and verify; optionally try a write; hold on demand."""
    from trims.runtime.client import StoreClient

    t0 = time.perf_counter()
    client = StoreClient(args.socket)
    lease = client.acquire(MODEL, tier="gpu")
    acquire_s = time.perf_counter() - t0
    dev = lease.device
    out: dict[str, Any] = {
        "acquire_s": acquire_s,
        "kind": lease.handle.get("kind"),
        "pid": os.getpid(),
    }
    t1 = time.perf_counter()
    verify(device_bytes(dev.pointer, lease.manifest.total_bytes), lease.manifest, args.model_mb)
    out["verify_s"] = time.perf_counter() - t1
    if out["kind"] == "cuda_vmm":
        out["read_only"] = (
            access_flags(dev.pointer, dev.device_index) == CU_MEM_ACCESS_FLAGS_PROT_READ
        )
    if args.hold:
        print(json.dumps(out), flush=True)
        sys.stdin.readline()
        lease.release()
        client.close()
        return out
    if args.attempt_write:
        if out.get("read_only"):
            out["write_refused"], out["write_detail"] = try_write(dev.pointer)
        else:
            out["write_refused"] = None
            out["write_detail"] = (
                "the driver refused a read-only import, so it is read-write: no write was tried"
            )
        # a refused write can leave this context broken: end without unmapping, the daemon's
        # lease ends with the connection
        print(json.dumps(out), flush=True)
        os._exit(0)
    lease.release()
    client.close()
    return out


def role_export_ipc(args: argparse.Namespace) -> dict[str, Any]:
    """Load the layout into a GPU tier with VMM off; print the cuda_ipc handle; hold till stdin."""
    from trims.cuda import CudaDriver
    from trims.daemon.tiers.gpu import GpuTier

    manifest, data = layout(args.model_mb)
    blob = Path(args.work) / "layout.bin"
    blob.write_bytes(data)
    tier = GpuTier(CudaDriver.open())
    tier.vmm = False
    tier.load(manifest.digest, blob, manifest.total_bytes, "gpucheck (legacy ipc)")
    export = tier.export(manifest.digest)
    print(json.dumps({"handle": export.handle, "manifest": manifest.to_dict()}), flush=True)
    sys.stdin.readline()
    tier.close()
    return {}


def role_read_ipc(args: argparse.Namespace) -> dict[str, Any]:
    from trims.layout import Manifest
    from trims.runtime.adapters.cuda import DeviceMapping

    doc = json.loads(sys.stdin.readline())
    manifest = Manifest.from_dict(doc["manifest"])
    t0 = time.perf_counter()
    mapping = DeviceMapping.import_handle(doc["handle"], [], manifest)
    import_s = time.perf_counter() - t0
    try:
        verify(device_bytes(mapping.pointer, manifest.total_bytes), manifest, args.model_mb)
    finally:
        mapping.close()
    return {"kind": mapping.kind, "import_s": import_s}


def role_torch_read(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from trims.runtime.adapters import torch as torch_adapter
    from trims.runtime.client import StoreClient

    if not torch.cuda.is_available():
        return {"skipped": f"no CUDA torch (torch {torch.__version__} sees no CUDA device)"}
    source = model_tensors(args.model_mb)
    with StoreClient(args.socket) as client, client.lease(MODEL, tier="gpu") as lease:
        t0 = time.perf_counter()
        tensors = torch_adapter.cuda_tensors(lease)
        torch.cuda.synchronize()
        build_s = time.perf_counter() - t0
        for name, array in source.items():
            t = tensors[name]
            if not t.is_cuda or not np.array_equal(t.cpu().numpy(), array):
                raise CheckFailed(f"cuda tensor {name} differs from its source array")
        del tensors
        torch.cuda.synchronize()
    return {"cuda_tensors_s": build_s, "torch": torch.__version__, "kind": lease.handle.get("kind")}


def layout(model_mb: int) -> tuple[Any, bytes]:
    """The canonical layout of the check's model, built the way the store builds it."""
    from trims.layout import Manifest, TensorSpec, plan, sha256_buffer

    arrays = model_tensors(model_mb)
    entries, total = plan(TensorSpec(k, str(a.dtype), tuple(a.shape)) for k, a in arrays.items())
    buf = bytearray(total)
    for e in entries:
        buf[e.offset : e.offset + e.nbytes] = arrays[e.name].tobytes()
    manifest = Manifest(MODEL, "1", sha256_buffer(buf), "numpy", total, entries)
    return manifest, bytes(buf)


# ---- the checks (driver side) ---------------------------------------------------------------


def _me(role: str, args: argparse.Namespace, *extra: str) -> list[str]:
    return [
        sys.executable,
        __file__,
        role,
        "--work",
        str(args.work),
        "--model-mb",
        str(args.model_mb),
        *extra,
    ]


def _child(cmd: list[str], stdin: str | None = None) -> dict[str, Any]:
    """Run a second process to the end; its last stdout line is its JSON result. Its stderr
    goes on to ours (the kit's log); a failure's last line becomes the message."""
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, check=False)
    sys.stderr.write(proc.stderr)
    last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:500]
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise CheckFailed(f"the {cmd[2]} process exited {proc.returncode}: {last}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


@contextmanager
def gpu_daemon(args: argparse.Namespace) -> Iterator[tuple[Any, Path]]:
    """A daemon with a GPU tier and the check's model in it, loaded into the GPU tier."""
    from trims.runtime.client import StoreClient

    root = Path(tempfile.mkdtemp(prefix="daemon-", dir=args.work))
    proc, sock = start_daemon(root, cpu_budget="8GiB", gpu_budget="8GiB", timeout_s=60)
    try:
        path = root / "model.safetensors"
        write_safetensors(path, model_tensors(args.model_mb))
        with StoreClient(sock) as admin:
            admin.add(MODEL, path)
            gpu = admin.stats()["tiers"].get("gpu", {})
            if not gpu.get("available"):
                lines = (root / "daemon.log").read_text().splitlines()
                why = [ln for ln in lines if "gpu tier is off" in ln]
                raise CheckFailed(f"the daemon's gpu tier is off: {(why or ['see the log'])[-1]}")
            t0 = time.perf_counter()
            admin.load(MODEL, tier="gpu")
            args.load_s = time.perf_counter() - t0
            yield admin, sock
    finally:
        proc.stop()
        log = (root / "daemon.log").read_text(errors="replace")
        sys.stderr.write(f"--- daemon log ---\n{log}--- end of daemon log ---\n")


def check_tier(args: argparse.Namespace) -> dict[str, Any]:
    """The daemon's own export path, then the legacy cuda_ipc path; each is tried and reported
    whatever the other did."""
    figures: dict[str, Any] = {}
    problems: list[str] = []
    try:
        figures.update(daemon_export(args))
    except Exception as e:
        problems.append(f"daemon export: {e}")
    try:
        figures["legacy_ipc"] = legacy_ipc(args)
    except Exception as e:
        problems.append(f"legacy cuda_ipc: {e}")
    if problems:
        return {"status": "failed", "figures": figures, "detail": "; ".join(problems)}
    kind = figures["handle_kind"]
    return {
        "status": "passed",
        "figures": figures,
        "detail": f"{kind} and legacy cuda_ipc imports read the right bytes",
    }


def daemon_export(args: argparse.Namespace) -> dict[str, Any]:
    """A second process reads the GPU-tier model, tries a write, and a third re-reads it."""
    figures: dict[str, Any] = {}
    with gpu_daemon(args) as (admin, sock):
        figures["load_into_gpu_tier_s"] = args.load_s
        first = _child(_me("read", args, "--socket", str(sock), "--attempt-write"))
        figures.update(
            handle_kind=first["kind"],
            acquire_s=first["acquire_s"],
            read_only_import=first.get("read_only"),
            write_refused=first.get("write_refused"),
            write_detail=first.get("write_detail"),
        )
        if first.get("write_refused") is False:
            raise CheckFailed(
                f"a write through the read-only import was not refused ({first['write_detail']})"
            )
        again = _child(_me("read", args, "--socket", str(sock)))
        figures["bytes_intact_after_write_attempt"] = True
        figures["second_acquire_s"] = again["acquire_s"]
        figures["gpu_tier_used_bytes"] = admin.stats()["tiers"]["gpu"].get("used")
    return figures


def _spawn(cmd: list[str]) -> subprocess.Popen[str]:
    """A child of this check with pipes for its stdin, stdout and stderr."""
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def _first_line(proc: subprocess.Popen[str], what: str) -> str:
    """``proc``'s first stdout line; CheckFailed with its last stderr line when it ends first
    (its whole stderr goes on to ours, the kit's log)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        err = proc.stderr.read() if proc.stderr else ""
        sys.stderr.write(err)
        last = (err.strip().splitlines() or ["(no output)"])[-1]
        raise CheckFailed(f"{what} failed: {last}")
    return line


def legacy_ipc(args: argparse.Namespace) -> dict[str, Any]:
    """Export with VMM off in one process, import with the runtime adapter in another."""
    exporter = _spawn(_me("export-ipc", args))
    try:
        line = _first_line(exporter, "the exporter process")
        result = _child(_me("read-ipc", args), stdin=line)
        if result["kind"] != "cuda_ipc":
            raise CheckFailed(f"the legacy path imported a {result['kind']} handle")
        return {"kind": "cuda_ipc", "import_s": result["import_s"], "verified": True}
    finally:
        if exporter.stdin is not None:
            exporter.stdin.close()
        try:
            exporter.wait(30)
        except subprocess.TimeoutExpired:
            exporter.kill()
            exporter.wait()


def check_torch(args: argparse.Namespace) -> dict[str, Any]:
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; print(int(torch.cuda.is_available()), torch.__version__)",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        return {
            "status": "skipped",
            "figures": {},
            "detail": "skipped: no CUDA torch (torch does not import)",
        }
    cuda, version = probe.stdout.split()
    if cuda != "1":
        return {
            "status": "skipped",
            "figures": {},
            "detail": f"skipped: no CUDA torch (torch {version})",
        }
    with gpu_daemon(args) as (_admin, sock):
        result = _child(_me("torch-read", args, "--socket", str(sock)))
    if "skipped" in result:
        return {"status": "skipped", "figures": {}, "detail": f"skipped: {result['skipped']}"}
    return {
        "status": "passed",
        "figures": result,
        "detail": "cuda_tensors equal their source arrays",
    }


def gpu_memory_mib() -> dict[str, Any]:
    """Device memory used (whole device, and per process where nvidia-smi lists them)."""
    used = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    apps = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    )
    per_pid: dict[str, float] = {}
    for line in apps.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[1].replace(".", "").isdigit():
            per_pid[parts[0]] = float(parts[1])
    text = used.stdout.strip()
    total = float(text) if text.replace(".", "", 1).isdigit() else None  # "[N/A]" in some VMs
    return {"device_used_mib": total, "per_process_mib": per_pid}


def check_share(args: argparse.Namespace) -> dict[str, Any]:
    before = gpu_memory_mib()
    holders: list[subprocess.Popen[str]] = []
    with gpu_daemon(args) as (_admin, sock):
        loaded = gpu_memory_mib()
        try:
            for _ in range(args.processes):
                holders.append(_spawn(_me("read", args, "--socket", str(sock), "--hold")))
            results = [json.loads(_first_line(h, "a holder process")) for h in holders]
            holding = gpu_memory_mib()
        finally:
            for h in holders:
                if h.stdin is not None:
                    h.stdin.close()
            for h in holders:
                h.wait(60)
    acquire = [r["acquire_s"] for r in results]
    pids = {str(r["pid"]) for r in results}
    model_mib = layout_mib(args.model_mb)
    figures = {
        "processes": args.processes,
        "model_mib": model_mib,
        "acquire_s_median": statistics.median(acquire),
        "acquire_s_max": max(acquire),
        "device_used_mib_before": before["device_used_mib"],
        "device_used_mib_model_loaded": loaded["device_used_mib"],
        "device_used_mib_all_holding": holding["device_used_mib"],
        "added_per_process_mib": (
            (holding["device_used_mib"] - loaded["device_used_mib"]) / args.processes
            if holding["device_used_mib"] is not None and loaded["device_used_mib"] is not None
            else None
        ),
        "holder_process_mib": [v for k, v in holding["per_process_mib"].items() if k in pids],
    }
    return {
        "status": "passed",
        "figures": figures,
        "detail": f"{args.processes} processes read one device copy of {model_mib:.0f} MiB",
    }


def layout_mib(model_mb: int) -> float:
    return sum(a.nbytes for a in model_tensors(model_mb).values()) / (1 << 20)


DOUBLER = """
import numpy as np

def infer(inputs, ctx):
    return {"y": (inputs["x"] * 2).astype(np.float32)}

def handler(request, ctx):
    return b"use /v2"
"""


def check_cuda_shm(args: argparse.Namespace) -> dict[str, Any]:
    """Triton's CUDA shared-memory extension on a real gateway: a process exports device memory
    holding x (legacy CUDA IPC, what cudaIpcGetMemHandle gives a Triton client), the gateway
    registers it, an infer reads x from it and writes y = 2x back into it, and a third process
    opens the same handle and finds y there."""
    import base64
    import urllib.request

    import numpy as np

    from trims.runtime.adapters.cuda import IpcBuffer

    code = Path(args.work) / "cuda-shm-fn"
    code.mkdir(parents=True, exist_ok=True)
    (code / "handler.py").write_text(DOUBLER)
    for path in (code, code / "handler.py", Path(args.work)):
        path.chmod(0o755 if path.is_dir() else 0o644)
    exporter = subprocess.Popen(
        _me("export-ipc", args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    gateway = None
    try:
        assert exporter.stdout is not None and exporter.stdin is not None
        exported = json.loads(exporter.stdout.readline())
        raw = bytes.fromhex(exported["handle"]["ipc_handle"])
        size = int(exported["manifest"]["total_bytes"])
        x = np.arange(16, dtype=np.float32)
        IpcBuffer(0, raw, size).write(0, x.tobytes())  # the client fills its input
        log_path = Path(args.work) / "cuda-shm-gateway.log"
        with open(log_path, "wb") as log_file:
            gateway = subprocess.Popen(
                [sys.executable, "-m", "trims", "gateway", "--port", "0", "--no-auth",
                 "--preload", "numpy", "--store-socket", str(Path(args.work) / "none.sock")],
                stdout=subprocess.DEVNULL, stderr=log_file,
            )  # fmt: skip
        url = _wait_for_url(log_path, gateway)

        def call(method: str, path: str, body: Any) -> Any:
            data = None if body is None else json.dumps(body).encode()
            request = urllib.request.Request(
                url + path, method=method, data=data, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=60) as r:
                return json.loads(r.read() or b"{}")

        call("PUT", "/v1/functions/doubler", {
            "name": "doubler", "handler": "handler:handler", "code_dir": str(code),
            "serves": {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
                       "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}]},
        })  # fmt: skip
        t0 = time.perf_counter()
        call("POST", "/v2/cudasharedmemory/region/dev/register", {
            "raw_handle": {"b64": base64.b64encode(raw).decode()}, "device_id": 0,
            "byte_size": size,
        })  # fmt: skip
        register_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        answer = call("POST", "/v2/models/doubler/infer", {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [16], "parameters": {
                "shared_memory_region": "dev", "shared_memory_byte_size": 64}}],
            "outputs": [{"name": "y", "parameters": {
                "shared_memory_region": "dev", "shared_memory_byte_size": 64,
                "shared_memory_offset": 4096}}],
        })  # fmt: skip
        infer_s = time.perf_counter() - t0
        reader = IpcBuffer(0, raw, size)
        y = np.frombuffer(reader.read(4096, 64), dtype=np.float32)
        reader.close()
        if not np.array_equal(y, x * 2):
            raise CheckFailed(f"y in device memory is {y[:4]}..., expected {x[:4] * 2}...")
        regions = call("GET", "/v2/cudasharedmemory/status", None)
        if [r["name"] for r in regions] != ["dev"]:
            raise CheckFailed(f"the status lists {regions}, expected the region dev")
        call("POST", "/v2/cudasharedmemory/region/dev/unregister", {})
        params = answer["outputs"][0].get("parameters", {})
        if params.get("shared_memory_region") != "dev":
            raise CheckFailed(f"the answer's output names {params}, not the region dev")
        return {
            "status": "passed",
            "figures": {"register_ms": register_s * 1e3, "infer_ms": infer_s * 1e3},
            "detail": "y = 2x read back from device memory through a second handle",
        }
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(30)
        if exporter.stdin is not None:
            exporter.stdin.write("\n")
            exporter.stdin.flush()
        exporter.wait(30)


def _wait_for_url(log_path: Path, proc: subprocess.Popen[bytes]) -> str:
    """The URL a ``trims gateway`` prints once it listens (its log), or CheckFailed."""
    import re

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        found = re.search(r"trims gateway ready url=(\S+)", text)
        if found:
            return found.group(1)
        if proc.poll() is not None:
            raise CheckFailed(f"the gateway exited {proc.returncode}: {text[-500:]}")
        time.sleep(0.1)
    raise CheckFailed("the gateway did not get ready in 60 s")


CHECKS = {
    "tier": check_tier,
    "torch": check_torch,
    "share": check_share,
    "cuda-shm": check_cuda_shm,
}
ROLES = {
    "read": role_read,
    "export-ipc": role_export_ipc,
    "read-ipc": role_read_ipc,
    "torch-read": role_torch_read,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("role", choices=sorted({*CHECKS, *ROLES}))
    p.add_argument("--work", type=Path, required=True, help="a folder for sockets and files")
    p.add_argument("--json", type=Path, help="where a check writes its result")
    p.add_argument("--model-mb", type=int, default=64)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--socket", type=Path)
    p.add_argument("--attempt-write", action="store_true")
    p.add_argument("--hold", action="store_true")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.role in ROLES:
        try:
            result = ROLES[args.role](args)
        except Exception as e:  # the traceback goes to the log; the last line is the message
            traceback.print_exc()
            print(f"{args.role}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        if result:
            print(json.dumps(result), flush=True)
        return 0
    try:
        doc = CHECKS[args.role](args)
    except Exception as e:  # every failure becomes the check's result, never a traceback
        doc = {"status": "failed", "figures": {}, "detail": f"{type(e).__name__}: {e}"}
    text = json.dumps(doc, indent=1)
    if args.json:
        from trims.config import write_atomic

        write_atomic(args.json, text + "\n")
    print(text)
    return 0 if doc["status"] != "failed" else 1


if __name__ == "__main__":
    sys.exit(main())
