"""Kernel launch aggregation (KLAP): the index math, and a launcher that uses it.

Follows El Hajj et al., "KLAP: Kernel Launch Aggregation and Promotion for Optimizing Dynamic
Parallelism" (MICRO'16). When every parent thread launches a child grid, the launches of a
group of parents (a warp, a block or the whole grid) become one aggregated launch::

    parent p of the group writes   args[p], grid[p], block[p]
    the group computes             scan = inclusive_scan(grid)      (scan[-1] = total blocks)
                                   max_block = max(block)
    one thread launches            child<<<scan[-1], max_block>>>(args, scan, block)
    child prologue (every block)   p = first index with scan[p] > blockIdx.x   (binary search)
                                   blockIdx' = blockIdx.x - (p ? scan[p-1] : 0)
                                   gridDim'  = scan[p] - (p ? scan[p-1] : 0)
                                   threads with threadIdx.x >= block[p] return at once

:func:`aggregate` and :func:`child_prologue` are that math in NumPy (vectorized over all blocks
of the aggregated grid); :func:`find_parent` is the same binary search written the way the CUDA
prologue does it (``klap_cuda.cu``), so the tests can check the two against each other.

:class:`Launcher` runs "children" for a set of parents under one of the variants of the study:
``per-parent`` (one launch per parent; on a GPU without dynamic parallelism these are host-side
launches), ``warp`` / ``block`` / ``grid`` aggregation (one launch per group) and ``flat`` (no
child launches: the parent expands its own work). On the CPU a launch is simulated: all threads
of the launched grid run as one vectorized NumPy call over their (parent, item) indices.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from trims.errors import ValidationError

log = logging.getLogger(__name__)

Variant = Literal["per-parent", "warp", "block", "grid", "flat"]
VARIANTS: tuple[Variant, ...] = ("per-parent", "warp", "block", "grid", "flat")
WARP = 32

IntArray = npt.NDArray[np.int64]
#: body(parent, item): the child work, vectorized over threads; ``parent`` indexes the parents
#: given to :meth:`Launcher.children`, ``item`` counts from 0 within that parent's work.
Body = Callable[[IntArray, IntArray], None]


@dataclass(frozen=True)
class Aggregated:
    """One aggregated launch: per-parent arguments, the scan of grid sizes, the max block."""

    scan: IntArray
    block_dims: IntArray
    max_block: int
    args: Mapping[str, npt.NDArray[Any]] = field(default_factory=dict)

    @property
    def total_blocks(self) -> int:
        return int(self.scan[-1]) if self.scan.size else 0


@dataclass(frozen=True)
class Prologue:
    """What each block of an aggregated launch recovers about itself."""

    parent: IntArray
    block_idx: IntArray
    grid_dim: IntArray


def aggregate(
    grid_sizes: npt.ArrayLike,
    block_sizes: npt.ArrayLike,
    args: Mapping[str, npt.ArrayLike] | None = None,
) -> Aggregated:
    """The aggregated launch of one group of parents (grid size 0 means no launch)."""
    grid = np.asarray(grid_sizes, dtype=np.int64).reshape(-1)
    block = np.broadcast_to(np.asarray(block_sizes, dtype=np.int64), grid.shape).copy()
    if grid.size and (grid.min() < 0 or block.min() < 1):
        raise ValidationError("child grid sizes must be >= 0 and block sizes >= 1")
    arrays = {k: np.asarray(v) for k, v in (args or {}).items()}
    for name, a in arrays.items():
        if a.shape[:1] != grid.shape:
            raise ValidationError(f"argument array {name!r} needs one entry per parent")
    return Aggregated(
        scan=np.cumsum(grid),
        block_dims=block,
        max_block=int(block[grid > 0].max()) if (grid > 0).any() else 0,
        args=arrays,
    )


def child_prologue(scan: npt.ArrayLike, block_ids: npt.ArrayLike) -> Prologue:
    """Parent, original blockIdx and original gridDim of each aggregated block id."""
    s = np.asarray(scan, dtype=np.int64)
    b = np.asarray(block_ids, dtype=np.int64)
    if b.size and (b.min() < 0 or (s.size == 0) or b.max() >= s[-1]):
        raise ValidationError("block ids must lie in [0, scan[-1])")
    parent = np.searchsorted(s, b, side="right")
    start = np.where(parent > 0, s[np.maximum(parent - 1, 0)], 0)
    return Prologue(parent=parent, block_idx=b - start, grid_dim=s[parent] - start)


def find_parent(scan: npt.ArrayLike, block_id: int) -> int:
    """The device prologue's binary search: the first p with scan[p] > block_id."""
    s = np.asarray(scan, dtype=np.int64)
    lo, hi = 0, int(s.size) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if s[mid] > block_id:
            hi = mid
        else:
            lo = mid + 1
    return lo


def group_ids(n_parents: int, variant: Variant, parent_block: int) -> IntArray:
    """Which aggregation group each parent thread belongs to."""
    ids = np.arange(n_parents, dtype=np.int64)
    if variant == "warp":
        return ids // WARP
    if variant == "block":
        return ids // parent_block
    if variant == "grid":
        return np.zeros(n_parents, np.int64)
    return ids


def threads_of(agg: Aggregated) -> tuple[IntArray, IntArray, IntArray]:
    """(parent, blockIdx', threadIdx) of every live thread of an aggregated launch."""
    if agg.total_blocks == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    blocks = np.arange(agg.total_blocks, dtype=np.int64)
    pro = child_prologue(agg.scan, blocks)
    tid = np.arange(agg.max_block, dtype=np.int64)
    parent = np.repeat(pro.parent, agg.max_block)
    block_idx = np.repeat(pro.block_idx, agg.max_block)
    thread = np.tile(tid, agg.total_blocks)
    live = thread < agg.block_dims[parent]
    return parent[live], block_idx[live], thread[live]


def expand(counts: npt.ArrayLike) -> tuple[IntArray, IntArray]:
    """(parent, item) for every item of every parent, without launches (the flat variant)."""
    c = np.asarray(counts, dtype=np.int64)
    parent = np.repeat(np.arange(c.size, dtype=np.int64), c)
    starts = np.cumsum(c) - c
    return parent, np.arange(parent.size, dtype=np.int64) - starts[parent]


@dataclass
class Launcher:
    """Runs child work for parents under one variant and counts the launches it made."""

    variant: Variant
    parent_block: int = 128
    child_block: int = 64
    launches: int = 0

    def children(self, counts: npt.ArrayLike, body: Body) -> None:
        """Parent p asks for ``counts[p]`` work items, one child thread each."""
        c = np.asarray(counts, dtype=np.int64)
        if self.variant == "flat":
            parent, item = expand(c)
            if parent.size:
                body(parent, item)
            return
        grid = -(-c // self.child_block)
        groups = group_ids(c.size, self.variant, self.parent_block)
        if self.variant == "per-parent":
            for p in np.flatnonzero(grid):
                self._launch(np.int64(p), grid[p : p + 1], c[p : p + 1], body)
            return
        bounds = np.flatnonzero(np.diff(groups)) + 1
        starts = np.concatenate(([0], bounds)) if c.size else np.zeros(0, np.int64)
        ends = np.concatenate((bounds, [c.size])) if c.size else np.zeros(0, np.int64)
        for lo, hi in zip(starts, ends, strict=True):
            if grid[lo:hi].any():
                self._launch(np.int64(lo), grid[lo:hi], c[lo:hi], body)

    def _launch(self, first: np.int64, grid: IntArray, counts: IntArray, body: Body) -> None:
        self.launches += 1
        agg = aggregate(grid, self.child_block)
        parent, block_idx, thread = threads_of(agg)
        item = block_idx * self.child_block + thread
        keep = item < counts[parent]
        body(parent[keep] + first, item[keep])
