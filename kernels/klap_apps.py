"""Benchmarks with irregular nested parallelism, written against :class:`klap.Launcher`.

Each app has a plain reference (sequential Python or SciPy-free NumPy) and a launcher version
whose parent threads ask for child work; the variants of the study differ only in how those
children are launched, so every variant must give exactly the reference's result:

- BFS and SSSP (Bellman-Ford worklist) on R-MAT graphs: parents are frontier vertices, children
  one thread per outgoing edge;
- SpMV with power-law row lengths: parents are rows, children one thread per nonzero (atomic add);
- Mandelbrot by Mariani-Silver: parents are rectangles; a rectangle whose border has one dwell
  is filled by its children, a small one is computed per pixel, others split into 4 children
  that become the next generation's parents;
- tree traversal: parents are the nodes of one depth, children one thread per child node,
  computing each node's depth and root-path sum.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from trims.kernels.klap import IntArray, Launcher

Array = npt.NDArray[Any]


@dataclass(frozen=True)
class Csr:
    """A graph / sparse matrix in compressed rows."""

    indptr: IntArray
    indices: IntArray
    data: Array

    @property
    def n(self) -> int:
        return int(self.indptr.size - 1)

    def degrees(self) -> IntArray:
        return np.diff(self.indptr)


def csr_from_edges(n: int, src: IntArray, dst: IntArray, data: Array) -> Csr:
    order = np.lexsort((dst, src))
    indptr = np.zeros(n + 1, np.int64)
    np.add.at(indptr, src + 1, 1)
    return Csr(np.cumsum(indptr), dst[order].astype(np.int64), data[order])


def rmat(scale: int, edge_factor: int = 8, seed: int = 0, max_weight: int = 10) -> Csr:
    """Directed R-MAT graph (a, b, c, d = 0.57, 0.19, 0.19, 0.05), integer weights 1..max."""
    rng = np.random.default_rng(seed)
    m = edge_factor << scale
    src = np.zeros(m, np.int64)
    dst = np.zeros(m, np.int64)
    for bit in range(scale):
        r = rng.random(m)
        down = r >= 0.57 + 0.19
        right = ((r >= 0.57) & (r < 0.76)) | (r >= 0.95)
        src |= down.astype(np.int64) << bit
        dst |= right.astype(np.int64) << bit
    keep = src != dst
    weights = rng.integers(1, max_weight + 1, int(keep.sum())).astype(np.int64)
    return csr_from_edges(1 << scale, src[keep], dst[keep], weights)


def power_law_matrix(rows: int, cols: int, seed: int = 0, alpha: float = 1.5) -> Csr:
    """Sparse matrix whose row lengths follow a power law (Pareto), small integer values."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum((rng.pareto(alpha, rows) * 4).astype(np.int64), cols)
    src = np.repeat(np.arange(rows, dtype=np.int64), lengths)
    dst = rng.integers(0, cols, src.size).astype(np.int64)
    vals = rng.integers(-4, 5, src.size).astype(np.float64)
    return csr_from_edges(rows, src, dst, vals)


def random_tree(n: int, seed: int = 0) -> Csr:
    """A rooted tree (node 0) with power-law fan-out, as parent -> children CSR; weights 1..9."""
    rng = np.random.default_rng(seed)
    attach = np.zeros(n, np.int64)
    for v in range(1, n):
        attach[v] = int(v * (1.0 - rng.random() ** 0.25))
    weights = rng.integers(1, 10, n).astype(np.int64)
    children = np.arange(1, n, dtype=np.int64)
    return csr_from_edges(n, attach[1:], children, weights[1:])


# ----------------------------------------------------------------------------- BFS


def bfs_reference(g: Csr, source: int) -> IntArray:
    level = np.full(g.n, -1, np.int64)
    level[source] = 0
    queue = deque([source])
    while queue:
        v = queue.popleft()
        for u in g.indices[g.indptr[v] : g.indptr[v + 1]]:
            if level[u] < 0:
                level[u] = level[v] + 1
                queue.append(int(u))
    return level


def bfs(g: Csr, source: int, launcher: Launcher) -> IntArray:
    level = np.full(g.n, -1, np.int64)
    level[source] = 0
    frontier = np.array([source], np.int64)
    depth = 0
    while frontier.size:
        _bfs_level(g, level, frontier, depth, launcher)
        depth += 1
        frontier = np.flatnonzero(level == depth)
    return level


def _bfs_level(g: Csr, level: IntArray, frontier: IntArray, depth: int, launcher: Launcher) -> None:
    """One parent thread per frontier vertex; one child thread per outgoing edge."""
    starts = g.indptr[frontier]

    def visit(parent: IntArray, item: IntArray) -> None:
        nbr = g.indices[starts[parent] + item]
        level[nbr[level[nbr] < 0]] = depth + 1

    launcher.children(g.degrees()[frontier], visit)


# ----------------------------------------------------------------------------- SSSP


def sssp_reference(g: Csr, source: int) -> IntArray:
    inf = np.iinfo(np.int64).max
    dist = np.full(g.n, inf, np.int64)
    dist[source] = 0
    heap = [(0, source)]
    while heap:
        d, v = heapq.heappop(heap)
        if d > dist[v]:
            continue
        for e in range(g.indptr[v], g.indptr[v + 1]):
            u, nd = int(g.indices[e]), d + int(g.data[e])
            if nd < dist[u]:
                dist[u] = nd
                heapq.heappush(heap, (nd, u))
    return dist


def sssp(g: Csr, source: int, launcher: Launcher) -> IntArray:
    inf = np.iinfo(np.int64).max
    dist = np.full(g.n, inf, np.int64)
    dist[source] = 0
    frontier = np.array([source], np.int64)
    while frontier.size:
        before = dist.copy()
        _relax(g, dist, frontier, before[frontier], launcher)
        frontier = np.flatnonzero(dist < before)
    return dist


def _relax(g: Csr, dist: IntArray, frontier: IntArray, base: IntArray, launcher: Launcher) -> None:
    """One child thread per outgoing edge of a frontier vertex: atomicMin on the target."""
    starts = g.indptr[frontier]

    def relax(parent: IntArray, item: IntArray) -> None:
        e = starts[parent] + item
        np.minimum.at(dist, g.indices[e], base[parent] + g.data[e])

    launcher.children(g.degrees()[frontier], relax)


# ----------------------------------------------------------------------------- SpMV


def spmv_reference(a: Csr, x: Array) -> Array:
    y = np.zeros(a.n)
    for r in range(a.n):
        lo, hi = a.indptr[r], a.indptr[r + 1]
        y[r] = float(np.dot(a.data[lo:hi], x[a.indices[lo:hi]]))
    return y


def spmv(a: Csr, x: Array, launcher: Launcher) -> Array:
    y = np.zeros(a.n)
    starts = a.indptr[:-1]

    def row_products(parent: IntArray, item: IntArray) -> None:
        e = starts[parent] + item
        np.add.at(y, parent, a.data[e] * x[a.indices[e]])

    launcher.children(a.degrees(), row_products)
    return y


# ----------------------------------------------------------------------------- Mandelbrot


@dataclass(frozen=True)
class MandelbrotSpec:
    """Image of ``size`` x ``size`` pixels over [-1.5, 0.5] x [-1, 1]."""

    size: int = 256
    max_dwell: int = 256
    min_rect: int = 16
    max_depth: int = 5


def dwell(spec: MandelbrotSpec, ys: IntArray, xs: IntArray) -> IntArray:
    """Escape iteration count of pixels (ys, xs), capped at max_dwell."""
    c = (-1.5 + 2.0 * xs / spec.size) + 1j * (-1.0 + 2.0 * ys / spec.size)
    z = np.zeros_like(c)
    out = np.full(c.shape, spec.max_dwell, np.int64)
    alive = np.ones(c.shape, bool)
    for it in range(spec.max_dwell):
        z[alive] = z[alive] * z[alive] + c[alive]
        escaped = alive & (np.abs(z) > 2.0)
        out[escaped] = it
        alive &= ~escaped
        if not alive.any():
            break
    return out


def _border(x0: int, y0: int, s: int) -> tuple[IntArray, IntArray]:
    r = np.arange(s, dtype=np.int64)
    ys = np.concatenate([np.full(s, y0), np.full(s, y0 + s - 1), y0 + r, y0 + r])
    xs = np.concatenate([x0 + r, x0 + r, np.full(s, x0), np.full(s, x0 + s - 1)])
    return ys, xs


def mandelbrot_reference(spec: MandelbrotSpec) -> IntArray:
    """Sequential recursive Mariani-Silver."""
    img = np.full((spec.size, spec.size), -1, np.int64)

    def rect(x0: int, y0: int, s: int, depth: int) -> None:
        border = dwell(spec, *_border(x0, y0, s))
        if (border == border[0]).all():
            img[y0 : y0 + s, x0 : x0 + s] = border[0]
        elif s <= spec.min_rect or depth >= spec.max_depth:
            yy, xx = np.mgrid[y0 : y0 + s, x0 : x0 + s]
            img[y0 : y0 + s, x0 : x0 + s] = dwell(spec, yy, xx)
        else:
            h = s // 2
            for dy in (0, h):
                for dx in (0, h):
                    rect(x0 + dx, y0 + dy, h, depth + 1)

    rect(0, 0, spec.size, 0)
    return img


def mandelbrot_brute(spec: MandelbrotSpec) -> IntArray:
    yy, xx = np.mgrid[0 : spec.size, 0 : spec.size]
    return dwell(spec, yy, xx)


def mandelbrot(spec: MandelbrotSpec, launcher: Launcher) -> IntArray:
    """Mariani-Silver by generations: each rectangle is a parent thread asking for children."""
    img = np.full((spec.size, spec.size), -1, np.int64)
    rects = np.array([[0, 0, spec.size]], np.int64)
    depth = 0
    while rects.size:
        rects = _mandelbrot_generation(spec, img, rects, depth, launcher)
        depth += 1
    return img


def _mandelbrot_generation(
    spec: MandelbrotSpec, img: IntArray, rects: IntArray, depth: int, launcher: Launcher
) -> IntArray:
    """Rectangles (x0, y0, size) as parents; returns the next generation's rectangles."""
    x0, y0, s = rects[:, 0], rects[:, 1], rects[:, 2]
    same = np.zeros(len(rects), bool)
    common = np.zeros(len(rects), np.int64)
    for i in range(len(rects)):
        border = dwell(spec, *_border(int(x0[i]), int(y0[i]), int(s[i])))
        same[i] = (border == border[0]).all()
        common[i] = border[0]
    small = ~same & ((s <= spec.min_rect) | (depth >= spec.max_depth))
    split = ~same & ~small
    area = s * s

    def fill(parent: IntArray, item: IntArray) -> None:
        img[y0[parent] + item // s[parent], x0[parent] + item % s[parent]] = common[parent]

    def pixels(parent: IntArray, item: IntArray) -> None:
        ys, xs = y0[parent] + item // s[parent], x0[parent] + item % s[parent]
        img[ys, xs] = dwell(spec, ys, xs)

    children: list[IntArray] = []

    def subdivide(parent: IntArray, item: IntArray) -> None:
        h = s[parent] // 2
        children.append(
            np.stack([x0[parent] + (item % 2) * h, y0[parent] + (item // 2) * h, h], axis=1)
        )

    launcher.children(np.where(same, area, 0), fill)
    launcher.children(np.where(small, area, 0), pixels)
    launcher.children(np.where(split, 4, 0), subdivide)
    if not children:
        return np.zeros((0, 3), np.int64)
    nxt = np.concatenate(children)
    return nxt[np.lexsort(nxt.T[::-1])]


# ----------------------------------------------------------------------------- tree


def tree_reference(t: Csr) -> tuple[IntArray, IntArray]:
    """(depth, root-path weight sum) of every node, by an explicit-stack DFS."""
    depth = np.zeros(t.n, np.int64)
    path = np.zeros(t.n, np.int64)
    stack = [0]
    while stack:
        v = stack.pop()
        for e in range(t.indptr[v], t.indptr[v + 1]):
            c = int(t.indices[e])
            depth[c] = depth[v] + 1
            path[c] = path[v] + int(t.data[e])
            stack.append(c)
    return depth, path


def tree_traversal(t: Csr, launcher: Launcher) -> tuple[IntArray, IntArray]:
    depth = np.zeros(t.n, np.int64)
    path = np.zeros(t.n, np.int64)
    level = np.array([0], np.int64)
    while level.size:
        level = _tree_level(t, depth, path, level, launcher)
    return depth, path


def _tree_level(
    t: Csr, depth: IntArray, path: IntArray, nodes: IntArray, launcher: Launcher
) -> IntArray:
    """Nodes of one depth as parents, one child thread per child node; returns the next depth."""
    starts = t.indptr[nodes]
    found: list[IntArray] = []

    def visit(parent: IntArray, item: IntArray) -> None:
        e = starts[parent] + item
        child = t.indices[e]
        depth[child] = depth[nodes[parent]] + 1
        path[child] = path[nodes[parent]] + t.data[e]
        found.append(child)

    launcher.children(t.degrees()[nodes], visit)
    return np.sort(np.concatenate(found)) if found else np.zeros(0, np.int64)
