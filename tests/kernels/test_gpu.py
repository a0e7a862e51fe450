"""GPU paths (CuPy) against the NumPy paths; skipped with a reason where CUDA is absent."""

from __future__ import annotations

import numpy as np
import pytest

from trims.kernels.gpu import cupy_available, unavailable_reason

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy_available(), reason=unavailable_reason() or "no CUDA"),
]


@pytest.mark.parametrize("acc", ["fp16", "fp32"])
@pytest.mark.parametrize("segment", [16, 256, 48, 1024])
def test_cupy_matmul_path_within_bounds(segment: int, acc: str) -> None:
    import cupy as cp

    from trims.kernels import tcu

    x = np.random.default_rng(segment).uniform(-1, 1, 5000)
    for op, fn in (("reduce", tcu.segmented_reduce), ("scan", tcu.segmented_scan)):
        got = fn(cp.asarray(x), segment, acc, xp=cp).get()
        assert tcu.error_ratio(op, got, x, segment, acc) <= 1.0  # type: ignore[arg-type]


@pytest.mark.parametrize("acc", ["fp16", "fp32"])
@pytest.mark.parametrize("segment", [16, 256, 1024])
def test_wmma_kernels_within_bounds(segment: int, acc: str) -> None:
    import cupy as cp

    from trims.kernels import tcu

    kernels = tcu.wmma_kernels()
    x = np.random.default_rng(segment).uniform(-1, 1, 4096 + 100)
    x16 = cp.asarray(x.astype(np.float16))
    red = kernels.reduce(x16, segment, acc).get()  # type: ignore[arg-type]
    scan = kernels.scan(x16, segment, acc).get()  # type: ignore[arg-type]
    assert tcu.error_ratio("reduce", red, x, segment, acc) <= 1.0  # type: ignore[arg-type]
    assert tcu.error_ratio("scan", scan, x, segment, acc) <= 1.0  # type: ignore[arg-type]


def test_implicit_als_on_gpu_matches_cpu() -> None:
    from trims.kernels import als, als_data

    d = als_data.synthetic(300, 100, per_user=8, seed=3)
    cpu, gpu = als.Backend.numpy(), als.Backend.cupy()
    results = []
    for be in (cpu, gpu):
        c = be.csr(d.users, d.items, 1.0 + d.ratings, (d.n_users, d.n_items), np.float64)
        fit = als.fit_implicit(c, 8, 0.1, 3, be, dtype=np.float64)
        results.append(np.asarray(fit.x.get() if hasattr(fit.x, "get") else fit.x))
    assert np.allclose(results[0], results[1], atol=1e-6)


def test_transfer_gpu_modalities_run() -> None:
    from trims.kernels import transfer_gpu

    rows = transfer_gpu.run([1 << 12], repeat=2)
    names = {r[0] for r in rows}
    assert {"h2d-pinned", "d2h-pageable", "d2d", "zero-copy", "managed-demand"} <= names
    assert all(r[3] > 0 for r in rows)


def test_klap_gpu_variants_equal_references() -> None:
    from trims.kernels import klap_bench

    settings = klap_bench.KlapSettings(rmat_scale=8, spmv_rows=300, tree_nodes=300, repeat=1,
                                       backend="cupy")  # fmt: skip
    rows, _ = klap_bench.run(settings)
    assert {r.app for r in rows} == {"bfs", "sssp", "spmv", "tree"}
    assert all(r.correct for r in rows)
