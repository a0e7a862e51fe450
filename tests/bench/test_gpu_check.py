"""The GPU check kit off a GPU: its plan, a run that skips every step, and its figures.

The GPU run itself happens on a lent NVIDIA machine (docs/gpu.md); here the kit must say what it
would run, write its summary when there is nothing to run on, and pull its figures out of the
kernel studies' real JSON (the NumPy backends write the same shape as the CuPy ones).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.fixtures.store import DaemonProcess
from trims.runtime.client import StoreClient

REPO = Path(__file__).resolve().parents[2]
STEPS = ["device", "install", "gpu-tier", "torch-install", "torch-tensors", "pytest-gpu",
         "kernels-tcu", "kernels-klap", "kernels-transfer", "kernels-als", "oip-cuda-shm",
         "share-4"]  # fmt: skip


def _kit(*args: str, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), *args],
        env={**os.environ, "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _has_nvidia_device() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True, check=False).returncode == 0


def _bench(module: str) -> ModuleType:
    """A module of bench/ (scripts, not a package: imported with bench/ on sys.path)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(REPO / "bench"))


def _figures_module() -> ModuleType:
    return _bench("gpu_check_figures")


def test_plan_lists_every_step_with_its_time_box_and_runs_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _kit("--plan", out=out)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    listed = [ln.split()[0] for ln in lines[2:] if ln.split() and ln.split()[0] in STEPS]
    assert listed == STEPS
    for step in STEPS:
        line = next(ln for ln in lines if ln.startswith(step + " "))
        box = line.split()[1]
        assert box.endswith("s") and int(box[:-1]) > 0, line
    assert "total budget 480s" in proc.stdout
    assert not out.exists()


@pytest.mark.skipif(_has_nvidia_device(), reason="an NVIDIA device is here: the kit would run")
def test_without_a_device_every_step_is_skipped_with_the_reason(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _kit("--budget", "30", out=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((out / "gpu-check.json").read_text())
    assert "no NVIDIA device" in doc["device"]["error"]
    assert [s["step"] for s in doc["steps"]] == STEPS
    for s in doc["steps"]:
        assert s["status"] == "skipped", s
        assert s["detail"].startswith("skipped: no NVIDIA device"), s
        assert set(s) == {"step", "status", "seconds", "figures", "detail"}
    assert (out / "gpu-check.log").exists()
    assert "device" in proc.stdout and "skipped" in proc.stdout


def test_an_unknown_step_is_a_usage_error(tmp_path: Path) -> None:
    proc = _kit("--only", "gpu-tier,warp-drive", out=tmp_path / "out")
    assert proc.returncode == 2
    assert "unknown steps ['warp-drive']" in proc.stderr and "Traceback" not in proc.stderr


def _study(study: str, tmp_path: Path, *args: str) -> Any:
    out = tmp_path / f"{study}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "trims", "kernels", study, *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def test_tcu_figures_come_from_the_study_rows(tmp_path: Path) -> None:
    doc = _study("tcu", tmp_path, "--min-log2", "10", "--max-log2", "11", "--segments",
                 "16,256,0", "--repeat", "1")  # fmt: skip
    figures = _figures_module().tcu(doc)
    top = [r for r in doc["rows"] if r["total"] == 2048]
    assert figures["elements"] == 2048
    full = {r["method"]: r["copy_fraction"] for r in top
            if r["operation"] == "reduce" and r["segment"] == 0}  # fmt: skip
    assert figures["full_reduce_copy_fraction"] == full
    assert figures["baseline"] == "numpy"
    seg = {
        r["method"]: r["seconds"] for r in top if r["operation"] == "scan" and r["segment"] == 16
    }
    expected = {m: seg["numpy-cumsum"] / s for m, s in seg.items() if m != "numpy-cumsum"}
    assert figures["speedup_vs_baseline"]["scan_segment_16"] == expected
    assert set(figures["speedup_vs_baseline"]) == {
        f"{op}_segment_{n}" for op in ("reduce", "scan") for n in (16, 256)
    }


def test_klap_figures_come_from_the_study(tmp_path: Path) -> None:
    doc = _study("klap", tmp_path, "--rmat-scale", "5", "--spmv-rows", "32", "--mandelbrot-size",
                 "16", "--tree-nodes", "32", "--repeat", "1")  # fmt: skip
    figures = _figures_module().klap(doc)
    assert figures["geomean_speedup_over_per_parent"] == doc["geomean_speedup"]
    assert figures["per_parent_launch_side"] == ["simulated (numpy)"]
    assert figures["all_correct"] is True


def test_transfer_and_als_figures_take_only_what_the_study_wrote() -> None:
    figures = _figures_module()
    host_only = {"rows": [{"domain": "host", "modality": "copy", "size": 256, "cache": "warm",
                           "seconds": 1e-6, "bandwidth": 2.56e8}]}  # fmt: skip
    assert figures.transfer(host_only) == {}
    gpu = {"rows": [
        {"domain": "gpu", "modality": "h2d-pinned", "size": 1 << 20, "cache": "warm",
         "seconds": 1.0, "bandwidth": 2e10},
        {"domain": "gpu", "modality": "h2d-pinned", "size": 1 << 10, "cache": "warm",
         "seconds": 1.0, "bandwidth": 1e9},
    ]}  # fmt: skip
    assert figures.transfer(gpu) == {"size_bytes": 1 << 20, "gb_per_s": {"h2d-pinned (warm)": 20.0}}
    no_peer = {"implicit": {"s_per_iter": 0.5, "peer_s_per_iter": None}, "explicit": {}}
    got = figures.als(no_peer)
    assert got["implicit_s_per_iter"] == 0.5 and got["peer_cpu_s_per_iter"] is None
    assert "speedup_vs_peer_cpu" not in got


def test_the_tier_checks_model_goes_through_the_store_and_its_check_catches_a_bad_byte(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    """What the GPU-tier check writes, adds and verifies, through the CPU tier: the safetensors
    file it writes by hand is accepted, and its layout is the store's, byte for byte."""
    tier = _bench("gpu_tier_check")
    path = tmp_path / "model.safetensors"
    tier.write_safetensors(path, tier.model_tensors(1))
    daemon = start_daemon()
    with StoreClient(daemon.socket) as client:
        client.add(tier.MODEL, path)
        with client.acquire(tier.MODEL) as lease:
            data = bytes(lease.buffer())
            tier.verify(data, lease.manifest, 1)
            manifest, layout = tier.layout(1)
            assert manifest.digest == lease.manifest.digest and layout == data
            bad = bytearray(data)
            bad[lease.manifest.tensors[0].offset] ^= 1
            with pytest.raises(tier.CheckFailed, match="hash to"):
                tier.verify(bad, lease.manifest, 1)


FAKE_NVIDIA_SMI = """#!/bin/sh
case "$1" in
  -L) echo "GPU 0: NVIDIA Test (UUID: GPU-00000000-0000-0000-0000-000000000000)";;
  --query-gpu=name,uuid,driver_version,memory.total)
    echo "NVIDIA Test, GPU-00000000-0000-0000-0000-000000000000, 580.0, 1024 MiB";;
  --query*) ;;
  *) echo "| Driver Version: 580.0   CUDA Version: 13.0 |";;
esac
"""


@pytest.mark.skipif(_has_nvidia_device(), reason="an NVIDIA device is here: the step would pass")
def test_a_failing_step_is_reported_with_its_reason_and_the_exit_status_is_1(
    tmp_path: Path,
) -> None:
    """An nvidia-smi that lists a device the CUDA driver does not have: the GPU-tier step runs
    its real daemon and exporter, both find no CUDA, and the summary says so."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), "--only", "gpu-tier"],
        env={**os.environ, "OUT": str(out), "PATH": f"{bin_dir}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads((out / "gpu-check.json").read_text())
    assert doc["device"]["name"] == "NVIDIA Test" and doc["device"]["cuda_major"] == 13
    device, tier = doc["steps"]
    assert device["status"] == "passed"
    assert tier["step"] == "gpu-tier" and tier["status"] == "failed"
    assert "daemon export: the daemon's gpu tier is off" in tier["detail"]
    assert "legacy cuda_ipc: the exporter process failed" in tier["detail"]
    assert "Traceback" not in tier["detail"]
    assert "--- daemon log ---" in (out / "gpu-check.log").read_text()
