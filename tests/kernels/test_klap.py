"""KLAP aggregation math, exhaustively on small cases, and every variant against references."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from trims.errors import ValidationError
from trims.kernels import klap
from trims.kernels import klap_apps as apps


def _grid_vectors(max_len: int = 4, max_grid: int = 3) -> list[tuple[int, ...]]:
    return [
        g for n in range(1, max_len + 1) for g in itertools.product(range(max_grid + 1), repeat=n)
    ]


def test_prologue_recovers_parent_block_and_grid_exhaustively() -> None:
    for grids in _grid_vectors():
        agg = klap.aggregate(grids, 1)
        expected = [(p, b, g) for p, g in enumerate(grids) for b in range(g)]
        assert agg.total_blocks == len(expected) == sum(grids)
        if not expected:
            continue
        pro = klap.child_prologue(agg.scan, np.arange(agg.total_blocks))
        got = list(zip(pro.parent.tolist(), pro.block_idx.tolist(), pro.grid_dim.tolist(),
                       strict=True))  # fmt: skip
        assert got == expected, grids
        scalar = [klap.find_parent(agg.scan, b) for b in range(agg.total_blocks)]
        assert scalar == pro.parent.tolist()


def test_threads_of_masks_threads_beyond_each_parents_block_exhaustively() -> None:
    for grids in _grid_vectors(3, 2):
        for blocks in itertools.product((1, 2, 3), repeat=len(grids)):
            agg = klap.aggregate(grids, blocks)
            expected = sorted(
                (p, b, t) for p, g in enumerate(grids) for b in range(g) for t in range(blocks[p])
            )
            parent, block_idx, thread = klap.threads_of(agg)
            got = sorted(zip(parent.tolist(), block_idx.tolist(), thread.tolist(), strict=True))
            assert got == expected, (grids, blocks)
            launched = [b for g, b in zip(grids, blocks, strict=True) if g]
            assert agg.max_block == (max(launched) if launched else 0)


def test_aggregate_keeps_per_parent_arguments_and_rejects_bad_input() -> None:
    agg = klap.aggregate([1, 2], 32, {"start": [10, 20]})
    assert agg.args["start"].tolist() == [10, 20]
    with pytest.raises(ValidationError, match="one entry per parent"):
        klap.aggregate([1, 2], 32, {"start": [10]})
    with pytest.raises(ValidationError, match=">= 0"):
        klap.aggregate([-1], 32)
    with pytest.raises(ValidationError, match=r"\[0, scan\[-1\]\)"):
        klap.child_prologue([2, 3], [3])


@pytest.mark.parametrize("variant", klap.VARIANTS)
def test_launcher_runs_every_item_exactly_once(variant: klap.Variant) -> None:
    for counts in itertools.product((0, 1, 5, 64, 65), repeat=3):
        assert _items_run(variant, counts) == [
            (p, i) for p, c in enumerate(counts) for i in range(c)
        ]


def _items_run(variant: klap.Variant, counts: tuple[int, ...]) -> list[tuple[int, int]]:
    seen: list[tuple[int, int]] = []

    def body(parent: np.ndarray, item: np.ndarray) -> None:
        seen.extend(zip(parent.tolist(), item.tolist(), strict=True))

    klap.Launcher(variant, parent_block=2, child_block=16).children(counts, body)
    return sorted(seen)


def test_launch_counts_follow_the_granularity() -> None:
    counts = np.array([3, 0, 1, 7] * 20)  # 80 parents, 60 of them launch
    made = {}
    for variant in klap.VARIANTS:
        launcher = klap.Launcher(variant, parent_block=40, child_block=4)
        launcher.children(counts, lambda p, i: None)
        made[variant] = launcher.launches
    assert made == {"per-parent": 60, "warp": 3, "block": 2, "grid": 1, "flat": 0}


@pytest.mark.parametrize("variant", klap.VARIANTS)
def test_apps_equal_their_references(variant: klap.Variant) -> None:
    g = apps.rmat(7, seed=3)
    m = apps.power_law_matrix(200, 150, seed=3)
    x = (np.arange(150) % 5 - 2).astype(np.float64)
    spec = apps.MandelbrotSpec(size=64, max_dwell=64, min_rect=8)
    tree = apps.random_tree(300, seed=3)
    launcher = klap.Launcher(variant, parent_block=32, child_block=8)
    assert np.array_equal(apps.bfs(g, 0, launcher), apps.bfs_reference(g, 0))
    assert np.array_equal(apps.sssp(g, 0, launcher), apps.sssp_reference(g, 0))
    assert np.array_equal(apps.spmv(m, x, launcher), apps.spmv_reference(m, x))
    assert np.array_equal(apps.mandelbrot(spec, launcher), apps.mandelbrot_reference(spec))
    depth, path = apps.tree_traversal(tree, launcher)
    ref_depth, ref_path = apps.tree_reference(tree)
    assert np.array_equal(depth, ref_depth) and np.array_equal(path, ref_path)


def test_generators_have_the_intended_shape() -> None:
    g = apps.rmat(8, seed=1)
    assert g.n == 256 and g.indices.size > 1000
    assert (g.data >= 1).all() and (g.indices != np.repeat(np.arange(g.n), g.degrees())).all()
    lengths = apps.power_law_matrix(2000, 2000, seed=1).degrees()
    assert lengths.max() > 10 * max(1.0, float(np.median(lengths)))
    tree = apps.random_tree(100)
    assert tree.indices.size == 99 and sorted(tree.indices.tolist()) == list(range(1, 100))


def test_mariani_silver_matches_brute_force_on_a_coarse_image() -> None:
    spec = apps.MandelbrotSpec(size=64, max_dwell=64, min_rect=8)
    agree = (apps.mandelbrot_reference(spec) == apps.mandelbrot_brute(spec)).mean()
    assert agree > 0.99
