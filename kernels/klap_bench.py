"""The klap study: every app under every launch variant, checked against its reference.

Speedups are relative to one launch per parent (``per-parent``); on the CPU a launch is a
simulated grid (one vectorized NumPy call), so the speedups measure what aggregation saves in
per-launch overhead there, and the launch counts are the same as a GPU would make.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from trims.errors import TrimsError
from trims.kernels import klap_apps as apps
from trims.kernels.klap import VARIANTS, Launcher, Variant
from trims.kernels.timing import geomean, median_seconds

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KlapSettings:
    """Problem sizes of the CPU simulation (small: per-parent launches are a Python loop)."""

    rmat_scale: int = 12
    spmv_rows: int = 4096
    mandelbrot_size: int = 256
    tree_nodes: int = 8192
    repeat: int = 3
    seed: int = 0
    backend: str = "numpy"


@dataclass(frozen=True)
class KlapRow:
    app: str
    variant: str
    launch_side: str
    seconds: float
    launches: int
    speedup: float
    correct: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cases(s: KlapSettings) -> dict[str, tuple[Callable[[Launcher], Any], Any]]:
    """app -> (run(launcher) -> result, reference result)."""
    g = apps.rmat(s.rmat_scale, seed=s.seed)
    m = apps.power_law_matrix(s.spmv_rows, s.spmv_rows, seed=s.seed)
    x = (np.arange(s.spmv_rows) % 7 - 3).astype(np.float64)
    spec = apps.MandelbrotSpec(size=s.mandelbrot_size)
    tree = apps.random_tree(s.tree_nodes, seed=s.seed)
    return {
        "bfs": (lambda L: apps.bfs(g, 0, L), apps.bfs_reference(g, 0)),
        "sssp": (lambda L: apps.sssp(g, 0, L), apps.sssp_reference(g, 0)),
        "spmv": (lambda L: apps.spmv(m, x, L), apps.spmv_reference(m, x)),
        "mandelbrot": (lambda L: apps.mandelbrot(spec, L), apps.mandelbrot_reference(spec)),
        "tree": (lambda L: apps.tree_traversal(tree, L), apps.tree_reference(tree)),
    }


def results_equal(a: Any, b: Any) -> bool:
    """Exact equality of app results (arrays, or tuples of arrays)."""
    if isinstance(a, tuple):
        return all(results_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(np.array_equal(a, b))


def _launch(fn: Callable[[Launcher], object], variant: Variant) -> object:
    """One run of an application under ``variant``, on a fresh launcher (what is timed)."""
    return fn(Launcher(variant))


def run(settings: KlapSettings) -> tuple[list[KlapRow], dict[str, float]]:
    """Rows per (app, variant) and the geometric-mean speedup per variant."""
    if settings.backend == "cupy":
        from trims.kernels import klap_gpu

        rows = [KlapRow(**r) for r in klap_gpu.run(settings)]
        for r in rows:
            if not r.correct:
                raise TrimsError(f"klap {r.app} under {r.variant} on the GPU differs from its "
                                 "reference")  # fmt: skip
        return rows, {v: geomean([r.speedup for r in rows if r.variant == v]) for v in VARIANTS}
    rows = []
    for app, (fn, ref) in _cases(settings).items():
        base = 0.0
        for variant in VARIANTS:
            launcher = Launcher(variant)
            result = fn(launcher)
            launches = launcher.launches
            secs = median_seconds(
                functools.partial(_launch, fn, variant), repeat=settings.repeat, warmup=0
            )
            base = secs if variant == "per-parent" else base
            row = KlapRow(
                app=app,
                variant=variant,
                launch_side=_side(variant),
                seconds=secs,
                launches=launches,
                speedup=base / secs,
                correct=results_equal(result, ref),
            )
            if not row.correct:
                raise TrimsError(f"klap {app} under {variant} differs from its reference")
            log.info("klap %s %s: %.4f s, %d launches, %.2fx", app, variant, secs, launches,
                     row.speedup)  # fmt: skip
            rows.append(row)
    summary: dict[str, float] = {
        v: geomean([r.speedup for r in rows if r.variant == v]) for v in VARIANTS
    }
    return rows, summary


def _side(variant: Variant) -> str:
    if variant == "flat":
        return "none"
    return "simulated (numpy)"
