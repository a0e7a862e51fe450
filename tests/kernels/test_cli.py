"""``trims kernels ...`` end to end at tiny sizes, checking the JSON contracts."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from trims.cli import main
from trims.kernels.gpu import cupy_available


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "out.json"
    assert main(["kernels", *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.skipif(
    importlib.util.find_spec("recbole") is None,
    reason="recbole (MovieLens-100k) not installed: pip install --no-deps recbole",
)
def test_als_contract(tmp_path: Path) -> None:  # fmt: skip
    pytest.importorskip("implicit", reason="the peer library implicit is not installed")
    result = _run(tmp_path, "als", "--dataset", "ml-100k", "--iterations", "2", "--factors", "8",
                  "--explicit-iterations", "2")  # fmt: skip
    assert set(result) == {"explicit", "implicit"}
    for key in ("rmse", "s_per_iter"):
        assert isinstance(result["explicit"][key], float) and result["explicit"][key] > 0
    for key in ("precision_at_10", "s_per_iter", "peer_precision_at_10", "peer_s_per_iter"):
        assert isinstance(result["implicit"][key], float) and result["implicit"][key] > 0
    assert result["explicit"]["rmse"] < 2.0
    assert 0 < result["implicit"]["precision_at_10"] <= 1


def test_tcu_rows(tmp_path: Path) -> None:
    result = _run(tmp_path, "tcu", "--min-log2", "12", "--max-log2", "12", "--segments",
                  "16,256,0", "--repeat", "1", "--plots", str(tmp_path / "img"))  # fmt: skip
    keys = {(r["operation"], r["segment"], r["method"]) for r in result["rows"]}
    assert ("reduce", 16, "numpy-matmul-fp16") in keys and ("scan", 0, "numpy-cumsum") in keys
    assert len(keys) == len(result["rows"]) == 2 * 3 * 3
    for r in result["rows"]:
        assert r["total"] == 4096 and r["elements_per_s"] > 0 and r["copy_fraction"] > 0
        assert r["error_ratio"] is None or r["error_ratio"] <= 1.0
    assert (tmp_path / "img" / "tcu_throughput.png").stat().st_size > 0


def test_klap_rows(tmp_path: Path) -> None:
    result = _run(tmp_path, "klap", "--rmat-scale", "6", "--spmv-rows", "64",
                  "--mandelbrot-size", "32", "--tree-nodes", "64", "--repeat", "1")  # fmt: skip
    assert all(r["correct"] for r in result["rows"])
    assert {r["app"] for r in result["rows"]} == {"bfs", "sssp", "spmv", "mandelbrot", "tree"}
    assert result["geomean_speedup"]["per-parent"] == pytest.approx(1.0)


def test_transfer_rows(tmp_path: Path) -> None:
    result = _run(tmp_path, "transfer", "--min-log2", "8", "--max-log2", "8", "--repeat", "1",
                  "--no-ipc")  # fmt: skip
    assert {r["modality"] for r in result["rows"]} == {"copy", "copy-first-touch"}
    assert result["machine"]["cpus"] >= 1


def test_cupy_backend_without_cuda_fails_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    if cupy_available():
        pytest.skip("CUDA is present")
    assert main(["kernels", "tcu", "--backend", "cupy", "--max-log2", "12"]) == 1
    assert "CuPy/CUDA not available" in capsys.readouterr().err
