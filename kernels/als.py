"""ALS matrix factorization: explicit (weighted-lambda) and implicit (Hu-Koren-Volinsky, CG).

Explicit ALS-WR (Zhou et al. 2008) alternates exact solves; for every user u with n_u ratings::

    x_u = (sum_v theta_v theta_v^T + lambda n_u I)^-1  sum_v r_uv theta_v

and symmetrically for items. Rows are sorted by their number of ratings and solved in batches
whose rated factors are gathered into one padded (batch, degree, k) tensor, so each batch is a
few BLAS calls and one batched ``solve``.

Implicit ALS (Hu, Koren, Volinsky 2008) with the conjugate-gradient solver of Takacs et al., as
the ``implicit`` library does it: for confidences c_ui (the data of ``C``, 1 for unobserved
pairs) and preferences p_ui = 1 where c_ui is given::

    (Y^T Y + lambda I + sum_i (c_ui - 1) y_i y_i^T) x_u = sum_i c_ui y_i

solved by ``cg_steps`` CG iterations warm-started at the current x_u. Here the CG runs for all
rows of a block at once: each step is one gather of the rated factors, one row-wise dot, and one
sparse (rows x items) @ Y product. Rows are independent, so on the CPU they are split into one
contiguous block per thread (balanced by nonzeros) whose CGs run in a thread pool: NumPy and
SciPy release the GIL inside those kernels. On a GPU all rows form one block. Everything is
written against an array module ``xp`` (NumPy, or CuPy with cupyx.scipy.sparse on a GPU).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: elements of the gathered (batch, degree, k) tensor per explicit batch
GATHER_BUDGET = 1 << 21
#: nonzeros per chunk of the implicit CG's row-wise dot products (fits in L2 at k = 64)
DOT_CHUNK = 8192


@dataclass(frozen=True)
class Backend:
    """The array module and its sparse module: (numpy, scipy.sparse) or (cupy, cupyx...)."""

    xp: Any
    sparse: Any

    @staticmethod
    def numpy() -> Backend:
        import scipy.sparse

        return Backend(np, scipy.sparse)

    @staticmethod
    def cupy() -> Backend:
        from trims.kernels.gpu import require_cupy

        cp = require_cupy()
        import cupyx.scipy.sparse

        return Backend(cp, cupyx.scipy.sparse)

    def csr(self, rows: Any, cols: Any, data: Any, shape: tuple[int, int], dtype: Any) -> Any:
        """CSR matrix with sorted indices and summed duplicates."""
        xp = self.xp
        m = self.sparse.coo_matrix(
            (xp.asarray(data, dtype=dtype), (xp.asarray(rows), xp.asarray(cols))), shape=shape
        ).tocsr()
        m.sum_duplicates()
        m.sort_indices()
        return m


# ----------------------------------------------------------------------------- explicit


def explicit_half_step(r: Any, theta: Any, lam: float, be: Backend) -> Any:
    """New factors for the rows of ``r`` (CSR ratings) given the column factors ``theta``."""
    xp = be.xp
    n_rows, k = r.shape[0], theta.shape[1]
    indptr = xp.asarray(r.indptr)
    counts = xp.diff(indptr)
    out = xp.zeros((n_rows, k), dtype=theta.dtype)
    order = xp.argsort(counts)
    counts_sorted = counts[order]
    host_counts = np.asarray(
        counts_sorted.get() if hasattr(counts_sorted, "get") else counts_sorted
    )
    eye = xp.eye(k, dtype=theta.dtype)
    lo = int(np.searchsorted(host_counts, 1))
    while lo < n_rows:
        # the largest batch whose padded (batch, max degree, k) gather stays within budget
        ends = np.arange(lo + 1, min(n_rows, lo + max(1, GATHER_BUDGET // k)) + 1)
        cost = (ends - lo) * host_counts[ends - 1] * k
        hi = lo + max(1, int(np.searchsorted(cost, GATHER_BUDGET, side="right")))
        deg = int(host_counts[hi - 1])
        rows = order[lo:hi]
        n_u = counts[rows]
        pos = indptr[rows][:, None] + xp.arange(deg)[None, :]
        mask = xp.arange(deg)[None, :] < n_u[:, None]
        pos = xp.where(mask, pos, 0)
        g = theta[r.indices[pos]] * mask[..., None]
        vals = xp.where(mask, r.data[pos], 0)
        a = xp.matmul(xp.swapaxes(g, 1, 2), g) + lam * n_u[:, None, None] * eye
        b = xp.einsum("bdk,bd->bk", g, vals)
        out[rows] = xp.linalg.solve(a, b[..., None])[..., 0]
        lo = hi
    return out


def explicit_loss(r: Any, x: Any, y: Any, lam: float, be: Backend) -> float:
    """sum over ratings (r - x.y)^2 + lambda (sum_u n_u |x_u|^2 + sum_i n_i |y_i|^2)."""
    xp = be.xp
    coo = r.tocoo()
    pred = (x[coo.row] * y[coo.col]).sum(1)
    n_u = xp.diff(xp.asarray(r.indptr))
    n_i = xp.bincount(xp.asarray(coo.col), minlength=y.shape[0])
    reg = (n_u * (x * x).sum(1)).sum() + (n_i * (y * y).sum(1)).sum()
    return float(((coo.data - pred) ** 2).sum() + lam * reg)


def explicit_init(r: Any, n_items: int, k: int, seed: int, be: Backend, dtype: Any) -> Any:
    """Item factors: first column the item's mean rating, the rest small random values."""
    xp = be.xp
    rng = np.random.default_rng(seed)
    y = rng.uniform(-0.01, 0.01, (n_items, k))
    rt = r.T.tocsr()
    counts = np.asarray(_host(xp.diff(xp.asarray(rt.indptr))))
    sums = np.asarray(_host(rt.sum(axis=1))).reshape(-1)
    y[:, 0] = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)
    return xp.asarray(y, dtype=dtype)


# ----------------------------------------------------------------------------- implicit


@dataclass(frozen=True)
class _Structure:
    """Per-nonzero row ids of a CSR confidence matrix (or of one row block), computed once."""

    rows: Any
    cols: Any
    conf: Any
    indptr: Any
    counts: Any
    #: (first row, end row) of consecutive row ranges holding about DOT_CHUNK nonzeros each
    chunks: list[tuple[int, int]]
    #: (first row, end row, the block's own structure) of each row block; empty: one block
    blocks: list[tuple[int, int, _Structure]]


def _structure(c: Any, be: Backend, blocks: int = 1) -> _Structure:
    """The structure of ``c``, split into ``blocks`` contiguous row blocks of about equal nnz."""
    xp = be.xp
    indptr = xp.asarray(c.indptr)
    rows = xp.searchsorted(indptr[1:], xp.arange(int(c.nnz)), side="right")
    host_indptr = np.asarray(_host(indptr))
    starts = np.searchsorted(host_indptr, np.arange(0, host_indptr[-1], DOT_CHUNK), "right") - 1
    bounds = np.unique(np.append(starts, c.shape[0])).tolist()
    chunks = list(itertools.pairwise(bounds))
    parts: list[tuple[int, int, _Structure]] = []
    if blocks > 1:
        targets = np.linspace(0, host_indptr[-1], blocks + 1)[1:-1]
        edges = sorted({0, c.shape[0], *np.searchsorted(host_indptr, targets).tolist()})
        parts = [(a, b, _structure(c[a:b], be)) for a, b in itertools.pairwise(edges)]
    return _Structure(rows, xp.asarray(c.indices), xp.asarray(c.data), indptr, xp.diff(indptr),
                      chunks, parts)  # fmt: skip


def implicit_half_step(
    c: Any, s: _Structure, x: Any, y: Any, lam: float, cg_steps: int, be: Backend,
    pool: Executor | None = None,
) -> None:  # fmt: skip
    """Warm-started CG for all rows of ``x`` (updates ``x`` in place): one batched CG per row
    block of ``s``, the blocks run in ``pool`` when given."""
    xp = be.xp
    yty = y.T @ y + lam * xp.eye(y.shape[1], dtype=y.dtype)
    blocks = s.blocks or [(0, c.shape[0], s)]
    if pool is None or len(blocks) == 1:
        for a, b, sb in blocks:
            _block_cg(sb, x[a:b], y, yty, cg_steps, be)
        return
    futures = [pool.submit(_block_cg, sb, x[a:b], y, yty, cg_steps, be) for a, b, sb in blocks]
    for f in futures:
        f.result()


def _block_cg(s: _Structure, x: Any, y: Any, yty: Any, cg_steps: int, be: Backend) -> None:
    """The batched CG for the rows of one block; ``x`` is the block's view of the factors.

    Rows without nonzeros are set to zero, the exact solution of (Y^T Y + lambda I) x = 0 (as
    ``implicit`` does), rather than moved a few CG steps towards it."""
    xp = be.xp
    x[s.counts == 0] = 0
    yg = y[s.cols]
    shape = (x.shape[0], y.shape[0])

    def a_times(p: Any) -> Any:
        w = (s.conf - 1) * _row_dots(yg, p, s, xp)
        return p @ yty + be.sparse.csr_matrix((w, s.cols, s.indptr), shape=shape) @ y

    b = be.sparse.csr_matrix((s.conf, s.cols, s.indptr), shape=shape) @ y
    r = b - a_times(x)
    p = r.copy()
    rsold = (r * r).sum(1)
    for _ in range(cg_steps):
        active = rsold >= 1e-20
        if not bool(active.any()):
            break
        ap = a_times(p)
        pap = (p * ap).sum(1)
        alpha = xp.where(active & (pap > 0), rsold / xp.where(pap > 0, pap, 1), 0).astype(x.dtype)
        x += alpha[:, None] * p
        r -= alpha[:, None] * ap
        rsnew = (r * r).sum(1)
        beta = xp.where(active, rsnew / xp.where(rsold > 0, rsold, 1), 0).astype(x.dtype)
        p = r + beta[:, None] * p
        rsold = rsnew


@contextmanager
def _pool(threads: int) -> Iterator[Executor | None]:
    """A thread pool for the row blocks, or None for one thread."""
    if threads <= 1:
        yield None
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="als-cg") as pool:
        yield pool


def _row_dots(yg: Any, p: Any, s: _Structure, xp: Any) -> Any:
    """yg[e] . p[row of e] for every nonzero e.

    On the CPU the rows are sorted, so p's rows are repeated block by block, in chunks of about
    DOT_CHUNK nonzeros that stay in cache (2-3x faster than one pass over all nonzeros); on a GPU
    one gather does it.
    """
    if xp is not np:
        return xp.einsum("ij,ij->i", yg, p[s.rows])
    out = np.empty(yg.shape[0], dtype=np.result_type(yg, p))
    for a, b in s.chunks:
        lo, hi = int(s.indptr[a]), int(s.indptr[b])
        np.einsum("ij,ij->i", yg[lo:hi], np.repeat(p[a:b], s.counts[a:b], axis=0), out=out[lo:hi])
    return out


def implicit_loss(c: Any, x: Any, y: Any, lam: float, be: Backend) -> float:
    """sum_ui c_ui (p_ui - x_u.y_i)^2 + lambda (|X|^2 + |Y|^2), without the dense matrix:
    tr(X^T X Y^T Y) + sum over given pairs [c (1 - s)^2 - s^2], s = x_u.y_i."""
    xp = be.xp
    coo = c.tocoo()
    sc = (x[coo.row] * y[coo.col]).sum(1).astype(xp.float64)
    conf = coo.data.astype(xp.float64)
    total = float(xp.trace((x.T @ x).astype(xp.float64) @ (y.T @ y).astype(xp.float64)))
    total += float((conf * (1 - sc) ** 2 - sc**2).sum())
    return total + lam * float(
        (x.astype(xp.float64) ** 2).sum() + (y.astype(xp.float64) ** 2).sum()
    )


@dataclass(frozen=True)
class Fit:
    """Factors after training, with the time and loss of every iteration."""

    x: Any
    y: Any
    seconds: list[float]
    losses: list[float]


def fit_explicit(
    r: Any, k: int, lam: float, iterations: int, be: Backend, *, seed: int = 0,
    dtype: Any = np.float64, track_loss: bool = False,
) -> Fit:  # fmt: skip
    """ALS-WR on a CSR rating matrix (users x items)."""
    import time

    rt = r.T.tocsr()
    y = explicit_init(r, r.shape[1], k, seed, be, dtype)
    x = be.xp.zeros((r.shape[0], k), dtype=dtype)
    seconds: list[float] = []
    losses: list[float] = []
    for it in range(iterations):
        t0 = time.perf_counter()
        x = explicit_half_step(r, y, lam, be)
        y = explicit_half_step(rt, x, lam, be)
        _sync(be)
        seconds.append(time.perf_counter() - t0)
        if track_loss:
            losses.append(explicit_loss(r, x, y, lam, be))
            log.debug("explicit ALS iteration %d: loss %.6g", it, losses[-1])
    return Fit(x, y, seconds, losses)


def fit_implicit(
    c: Any, k: int, lam: float, iterations: int, be: Backend, *, cg_steps: int = 3,
    seed: int = 0, dtype: Any = np.float32, track_loss: bool = False, threads: int = 0,
) -> Fit:  # fmt: skip
    """Implicit ALS on a CSR confidence matrix (users x items); factors start uniform in
    [0, 0.01), drawn the way ``implicit`` draws them for the same seed. On the CPU the rows'
    CGs run in ``threads`` threads (0: one per CPU); on a GPU in one batched call."""
    import time

    xp = be.xp
    rng = np.random.default_rng(seed)
    x = xp.asarray(rng.random((c.shape[0], k), dtype=np.float32) * 0.01, dtype=dtype)
    y = xp.asarray(rng.random((c.shape[1], k), dtype=np.float32) * 0.01, dtype=dtype)
    ct = c.T.tocsr()
    ct.sort_indices()
    n_threads = 1 if xp is not np else threads or os.cpu_count() or 1
    s_users, s_items = _structure(c, be, n_threads), _structure(ct, be, n_threads)
    seconds: list[float] = []
    losses: list[float] = []
    with _pool(n_threads) as pool:
        for it in range(iterations):
            t0 = time.perf_counter()
            implicit_half_step(c, s_users, x, y, lam, cg_steps, be, pool)
            implicit_half_step(ct, s_items, y, x, lam, cg_steps, be, pool)
            _sync(be)
            seconds.append(time.perf_counter() - t0)
            if track_loss:
                losses.append(implicit_loss(c, x, y, lam, be))
                log.debug("implicit ALS iteration %d: loss %.6g", it, losses[-1])
    return Fit(x, y, seconds, losses)


def _sync(be: Backend) -> None:
    if be.xp is not np:
        be.xp.cuda.get_current_stream().synchronize()


def _host(a: Any) -> Any:
    return a.get() if hasattr(a, "get") else a
