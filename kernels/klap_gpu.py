"""The klap study on an NVIDIA GPU (CuPy): the CSR-shaped apps under every launch variant.

Kernels come from ``klap_cuda.cu``. With CUDA dynamic parallelism (the module compiles with
``-rdc=true`` and links the device runtime, which needs the CUDA toolkit's libcudadevrt.a) the
per-parent, warp and block variants launch their children from the device; otherwise the same
child kernels are launched by the host, one launch per parent or per group, and the rows say so
(``launch_side``). ``grid`` is always one host launch per generation after a device-side scan of
the child grid sizes; ``flat`` launches no children. Mariani-Silver stays on the CPU simulation.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trims.kernels import klap_apps as apps
from trims.kernels.gpu import require_cupy
from trims.kernels.klap import VARIANTS, WARP, Variant

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("klap_cuda.cu")
PARENT_BLOCK = 128
CHILD_BLOCK = 64


@dataclass
class GpuLauncher:
    """Launches the children of one generation of parents under one variant."""

    cp: Any
    module: Any
    cdp: bool
    variant: Variant
    launches: int = 0

    @property
    def side(self) -> str:
        if self.variant == "flat":
            return "none"
        if self.cdp and self.variant in ("per-parent", "warp", "block"):
            return "device (CDP)"
        return "host"

    def children(self, app: str, parents: Any, indptr: Any, args: tuple[Any, ...]) -> None:
        cp = self.cp
        n = int(parents.size)
        if n == 0:
            return
        parents = parents.astype(cp.int32)
        tail = (indptr, *args)
        if self.variant == "flat":
            self.module.get_function(f"flat_{app}")(
                (-(-n // PARENT_BLOCK),), (PARENT_BLOCK,), (np.int32(n), parents, *tail)
            )
            return
        counts = indptr[parents.astype(cp.int64) + 1] - indptr[parents]
        grids = (counts + CHILD_BLOCK - 1) // CHILD_BLOCK
        if self.side == "device (CDP)":
            name = {"per-parent": "perparent", "warp": "warp", "block": "block"}[self.variant]
            scratch = cp.empty(n, cp.int64)
            self.module.get_function(f"parent_{app}_{name}")(
                (-(-n // PARENT_BLOCK),), (PARENT_BLOCK,),
                (np.int32(n), parents, scratch, np.int32(CHILD_BLOCK), *tail),
                shared_mem=PARENT_BLOCK * 8,
            )  # fmt: skip
            self.launches += int(cp.count_nonzero(grids)) if name == "perparent" else -(-n // (
                WARP if name == "warp" else PARENT_BLOCK))  # fmt: skip
            return
        child = self.module.get_function(f"child_{app}")
        group = {"per-parent": 1, "warp": WARP, "block": PARENT_BLOCK, "grid": n}[self.variant]
        padded = cp.zeros(-(-n // group) * group, cp.int64)
        padded[:n] = grids
        scans = cp.cumsum(padded.reshape(-1, group), axis=1)
        totals = scans[:, -1].get()
        for g in np.flatnonzero(totals):
            lo = int(g) * group
            child(
                (int(totals[g]),), (CHILD_BLOCK,),
                (scans[g], np.int32(min(group, n - lo)), parents[lo:], np.int32(CHILD_BLOCK),
                 *tail),
            )  # fmt: skip
            self.launches += 1


def compile_module() -> tuple[Any, bool]:
    """(RawModule, has CDP): tries -rdc=true with the device runtime first."""
    cp = require_cupy()
    source = SOURCE.read_text()
    try:
        module = cp.RawModule(code=source, options=("-rdc=true", "-DKLAP_CDP"))
        module.compile()
        return module, True
    except Exception as e:  # no libcudadevrt.a, or a driver without CDP
        log.info("klap: no dynamic parallelism (%s); children are launched by the host", e)
    module = cp.RawModule(code=source)
    module.compile()
    return module, False


def _bfs(g: apps.Csr, launcher: GpuLauncher) -> Any:
    cp = launcher.cp
    indptr, indices = cp.asarray(g.indptr), cp.asarray(g.indices, dtype=cp.int32)
    level = cp.full(g.n, -1, cp.int32)
    level[0] = 0
    depth = 0
    frontier = cp.asarray([0], cp.int32)
    while frontier.size:
        launcher.children("bfs", frontier, indptr, (indices, level, np.int32(depth)))
        depth += 1
        frontier = cp.flatnonzero(level == depth)
    return level.get().astype(np.int64)


def _sssp(g: apps.Csr, launcher: GpuLauncher) -> Any:
    cp = launcher.cp
    indptr, indices = cp.asarray(g.indptr), cp.asarray(g.indices, dtype=cp.int32)
    weights = cp.asarray(g.data, dtype=cp.int64)
    inf = np.iinfo(np.int64).max
    dist = cp.full(g.n, inf, cp.uint64)
    dist[0] = 0
    frontier = cp.asarray([0], cp.int32)
    while frontier.size:
        before = dist.copy()
        launcher.children("sssp", frontier, indptr, (indices, weights, before, dist))
        frontier = cp.flatnonzero(dist < before)
    return dist.get().astype(np.int64)


def _spmv(m: apps.Csr, x: Any, launcher: GpuLauncher) -> Any:
    cp = launcher.cp
    y = cp.zeros(m.n, cp.float64)
    rows = cp.arange(m.n, dtype=cp.int32)
    launcher.children("spmv", rows, cp.asarray(m.indptr), (
        cp.asarray(m.indices, dtype=cp.int32), cp.asarray(m.data, dtype=cp.float64),
        cp.asarray(x, dtype=cp.float64), y))  # fmt: skip
    return y.get()


def _tree(t: apps.Csr, launcher: GpuLauncher) -> Any:
    cp = launcher.cp
    indptr, indices = cp.asarray(t.indptr), cp.asarray(t.indices, dtype=cp.int32)
    weights = cp.asarray(t.data, dtype=cp.int64)
    depth = cp.zeros(t.n, cp.int64)
    path = cp.zeros(t.n, cp.int64)
    level = cp.asarray([0], cp.int32)
    while level.size:
        launcher.children("tree", level, indptr, (indices, weights, depth, path))
        starts, ends = indptr[level], indptr[level.astype(cp.int64) + 1]
        nxt = [indices[int(a) : int(b)] for a, b in zip(starts.get(), ends.get(), strict=True)]
        level = cp.sort(cp.concatenate(nxt)) if nxt else cp.zeros(0, cp.int32)
    return depth.get(), path.get()


def _launch(
    fn: Callable[[GpuLauncher], object], cp: Any, module: Any, cdp: bool, variant: Variant
) -> object:
    """One run of an application under ``variant``, on a fresh launcher (what is timed)."""
    return fn(GpuLauncher(cp, module, cdp, variant))


def run(settings: Any) -> list[dict[str, Any]]:
    """Rows like :class:`trims.kernels.klap_bench.KlapRow` for bfs, sssp, spmv and tree."""
    from trims.kernels.klap_bench import results_equal
    from trims.kernels.timing import median_seconds

    cp = require_cupy()
    module, cdp = compile_module()
    g = apps.rmat(settings.rmat_scale, seed=settings.seed)
    m = apps.power_law_matrix(settings.spmv_rows, settings.spmv_rows, seed=settings.seed)
    x = (np.arange(settings.spmv_rows) % 7 - 3).astype(np.float64)
    tree = apps.random_tree(settings.tree_nodes, seed=settings.seed)
    cases: dict[str, tuple[Callable[[GpuLauncher], Any], Any]] = {
        "bfs": (lambda L: _bfs(g, L), apps.bfs_reference(g, 0)),
        "sssp": (lambda L: _sssp(g, L), apps.sssp_reference(g, 0)),
        "spmv": (lambda L: _spmv(m, x, L), apps.spmv_reference(m, x)),
        "tree": (lambda L: _tree(tree, L), apps.tree_reference(tree)),
    }
    sync = cp.cuda.get_current_stream().synchronize
    rows: list[dict[str, Any]] = []
    for app, (fn, ref) in cases.items():
        base = 0.0
        for variant in VARIANTS:
            launcher = GpuLauncher(cp, module, cdp, variant)
            result = fn(launcher)
            secs = median_seconds(
                functools.partial(_launch, fn, cp, module, cdp, variant),
                repeat=settings.repeat, sync=sync,
            )  # fmt: skip
            base = secs if variant == "per-parent" else base
            rows.append(
                {
                    "app": app,
                    "variant": variant,
                    "launch_side": launcher.side,
                    "seconds": secs,
                    "launches": launcher.launches,
                    "speedup": base / secs,
                    "correct": results_equal(result, ref),
                }
            )
    return rows
