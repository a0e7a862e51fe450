"""The CUDA sources compile with nvcc (the kernels themselves need a GPU to run)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from trims.kernels import klap_gpu, tcu

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) absent")


def _compile(source: Path, out: Path, *flags: str) -> str:
    proc = subprocess.run(
        ["nvcc", "-arch=sm_80", "-std=c++17", *flags, "-c", str(source), "-o", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return subprocess.run(["nm", str(out)], capture_output=True, text=True).stdout


def test_wmma_kernels_compile(tmp_path: Path) -> None:
    symbols = _compile(tcu.WMMA_SOURCE_PATH, tmp_path / "tcu.o")
    for name in ("reduce16_fp16", "reduce256n_fp32", "scan16_fp32", "scan256n_fp16"):
        assert name in symbols


def test_klap_kernels_compile_with_dynamic_parallelism(tmp_path: Path) -> None:
    symbols = _compile(klap_gpu.SOURCE, tmp_path / "klap.o", "-rdc=true", "-DKLAP_CDP")
    for app in ("bfs", "sssp", "spmv", "tree"):
        for kind in ("child", "flat", "parent_{}_perparent", "parent_{}_warp", "parent_{}_block"):
            name = kind.format(app) if "{}" in kind else f"{kind}_{app}"
            assert name in symbols
