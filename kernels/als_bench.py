"""The ALS study: explicit RMSE and implicit ranking quality and speed, beside ``implicit``.

Both implicit models (ours and the ``implicit`` library's) train on the same confidence matrix
(c_ui = 1 + alpha r_ui for every training rating) with the same factors, regularization,
iterations and CG steps; both are scored by the same :func:`ranking_metrics` on the same
held-out 20%. Seconds per iteration are the median over iterations of one full alternation.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from trims.errors import NotFound
from trims.kernels import als
from trims.kernels.als_data import Ratings, load_ml100k, split, synthetic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AlsSettings:
    """The study's settings; explicit defaults reach RMSE < 0.95 on the ML-100k split."""

    dataset: str = "ml-100k"
    backend: str = "numpy"
    explicit_factors: int = 10
    explicit_lambda: float = 0.1
    explicit_iterations: int = 15
    implicit_factors: int = 64
    implicit_lambda: float = 0.01
    implicit_alpha: float = 1.0
    implicit_iterations: int = 15
    cg_steps: int = 3
    #: threads for our implicit CG's row blocks on the CPU; 0: one per CPU
    implicit_threads: int = 0
    peer: bool = True
    seed: int = 0
    synthetic_users: int = 20000
    synthetic_items: int = 5000


@dataclass(frozen=True)
class ExplicitResult:
    rmse: float
    s_per_iter: float
    factors: int
    iterations: int


@dataclass(frozen=True)
class ImplicitResult:
    precision_at_10: float
    ndcg_at_10: float
    s_per_iter: float
    peer_precision_at_10: float | None
    peer_ndcg_at_10: float | None
    peer_s_per_iter: float | None
    factors: int
    iterations: int


def load(settings: AlsSettings) -> Ratings:
    if settings.dataset == "ml-100k":
        return load_ml100k()
    if settings.dataset == "synthetic":
        return synthetic(settings.synthetic_users, settings.synthetic_items, seed=settings.seed)
    raise NotFound(f"unknown dataset {settings.dataset!r}; choose ml-100k or synthetic")


def rmse(fit: als.Fit, train: Ratings, test: Ratings) -> float:
    """Test RMSE with predictions clipped to [1, 5]; rows unseen in training get the mean."""
    x, y = (np.asarray(_host(a), dtype=np.float64) for a in (fit.x, fit.y))
    pred = np.clip((x[test.users] * y[test.items]).sum(1), 1.0, 5.0)
    seen_u = np.zeros(train.n_users, bool)
    seen_u[train.users] = True
    seen_i = np.zeros(train.n_items, bool)
    seen_i[train.items] = True
    unseen = ~(seen_u[test.users] & seen_i[test.items])
    pred[unseen] = float(train.ratings.mean())
    return float(np.sqrt(np.mean((pred - test.ratings) ** 2)))


def ranking_metrics(
    x: Any, y: Any, train: Ratings, test: Ratings, k: int = 10
) -> tuple[float, float]:
    """(precision@k, NDCG@k) over users with held-out items; training items are excluded.

    precision@k = hits in the top k / k; NDCG@k with binary relevance, ideal DCG over
    min(k, held-out count).
    """
    xu = np.asarray(_host(x), dtype=np.float32)
    yi = np.asarray(_host(y), dtype=np.float32)
    users = np.unique(test.users)
    test_sets = _by_user(test, users)
    train_sets = _by_user(train, users)
    discounts = 1.0 / np.log2(np.arange(2, k + 2))
    precisions, ndcgs = [], []
    for lo in range(0, users.size, 512):
        chunk = users[lo : lo + 512]
        scores = xu[chunk] @ yi.T
        for j, u in enumerate(chunk):
            scores[j, train_sets[u]] = -np.inf
        top = np.argpartition(-scores, k, axis=1)[:, :k]
        order = np.take_along_axis(scores, top, 1).argsort(axis=1)[:, ::-1]
        top = np.take_along_axis(top, order, 1)
        for j, u in enumerate(chunk):
            rel = np.isin(top[j], test_sets[u])
            precisions.append(rel.sum() / k)
            ideal = discounts[: min(k, test_sets[u].size)].sum()
            ndcgs.append(float((rel * discounts).sum() / ideal))
    return float(np.mean(precisions)), float(np.mean(ndcgs))


def _by_user(data: Ratings, users: Any) -> dict[int, Any]:
    order = np.argsort(data.users, kind="stable")
    us, its = data.users[order], data.items[order]
    starts = np.searchsorted(us, users, "left")
    ends = np.searchsorted(us, users, "right")
    return {int(u): its[a:b] for u, a, b in zip(users, starts, ends, strict=True)}


def run_explicit(s: AlsSettings, train: Ratings, test: Ratings, be: als.Backend) -> ExplicitResult:
    r = be.csr(train.users, train.items, train.ratings, (train.n_users, train.n_items),
               np.float64)  # fmt: skip
    fit = als.fit_explicit(r, s.explicit_factors, s.explicit_lambda, s.explicit_iterations, be,
                           seed=s.seed)  # fmt: skip
    result = ExplicitResult(rmse(fit, train, test), statistics.median(fit.seconds),
                            s.explicit_factors, s.explicit_iterations)  # fmt: skip
    log.info("explicit ALS on %s: RMSE %.4f, %.4f s/iteration", train.name, result.rmse,
             result.s_per_iter)  # fmt: skip
    return result


def confidences(train: Ratings, alpha: float, be: als.Backend) -> Any:
    """CSR users x items with c_ui = 1 + alpha r_ui (float32, like ``implicit``)."""
    return be.csr(train.users, train.items, 1.0 + alpha * train.ratings,
                  (train.n_users, train.n_items), np.float32)  # fmt: skip


def run_implicit(s: AlsSettings, train: Ratings, test: Ratings, be: als.Backend) -> ImplicitResult:
    c = confidences(train, s.implicit_alpha, be)
    fit = als.fit_implicit(c, s.implicit_factors, s.implicit_lambda, s.implicit_iterations, be,
                           cg_steps=s.cg_steps, seed=s.seed,
                           threads=s.implicit_threads)  # fmt: skip
    p10, ndcg = ranking_metrics(fit.x, fit.y, train, test)
    peer: tuple[float, float, float] | tuple[None, None, None] = (None, None, None)
    if s.peer:
        peer = _peer(s, confidences(train, s.implicit_alpha, als.Backend.numpy()), train, test)
    result = ImplicitResult(p10, ndcg, statistics.median(fit.seconds), peer[0], peer[1], peer[2],
                            s.implicit_factors, s.implicit_iterations)  # fmt: skip
    log.info("implicit ALS on %s: P@10 %.4f (implicit %s), %.4f s/iteration (implicit %s)",
             train.name, p10, peer[0], result.s_per_iter, peer[2])  # fmt: skip
    return result


def _peer(s: AlsSettings, c: Any, train: Ratings, test: Ratings) -> tuple[float, float, float]:
    """The ``implicit`` library's CPU ALS on the same matrix and settings."""
    try:
        from implicit.cpu.als import AlternatingLeastSquares
    except ImportError as e:
        raise NotFound("the peer library is missing: pip install implicit") from e
    with warnings.catch_warnings():
        # implicit's BLAS-threads check does not see threadpoolctl's limit, which run() sets
        warnings.filterwarnings("ignore", "OpenBLAS is configured", RuntimeWarning)
        model = AlternatingLeastSquares(
            factors=s.implicit_factors, regularization=s.implicit_lambda, alpha=1.0,
            dtype=np.float32, use_cg=True, iterations=s.implicit_iterations,
            random_state=s.seed,
        )  # fmt: skip
    model.cg_steps = s.cg_steps
    seconds: list[float] = []
    last = [time.perf_counter()]

    def tick(_it: int, _elapsed: float, _loss: Any) -> None:
        now = time.perf_counter()
        seconds.append(now - last[0])
        last[0] = now

    last[0] = time.perf_counter()
    model.fit(c, show_progress=False, callback=tick)
    p10, ndcg = ranking_metrics(model.user_factors, model.item_factors, train, test)
    return p10, ndcg, statistics.median(seconds)


def run(settings: AlsSettings) -> dict[str, Any]:
    """The study. The result is the CLI's JSON contract: ``{"explicit": {"rmse", "s_per_iter",
    ...}, "implicit": {"precision_at_10", "s_per_iter", "peer_precision_at_10",
    "peer_s_per_iter", ...}}`` (``...``: NDCG, factors, iterations, dataset, settings).

    BLAS runs single-threaded during the study (``implicit`` asks for that, and its own loops
    are multi-threaded): many small GEMMs lose more to thread hand-offs than they gain.
    """
    be = als.Backend.cupy() if settings.backend == "cupy" else als.Backend.numpy()
    data = load(settings)
    train, test = split(data, 0.2, settings.seed)
    with _single_threaded_blas():
        explicit = run_explicit(settings, train, test, be)
        implicit = run_implicit(settings, train, test, be)
    where = {"dataset": data.name, "backend": settings.backend}
    return {
        "explicit": {**asdict(explicit), **where, "regularization": settings.explicit_lambda},
        "implicit": {**asdict(implicit), **where, "regularization": settings.implicit_lambda,
                     "alpha": settings.implicit_alpha, "cg_steps": settings.cg_steps},
    }  # fmt: skip


def _single_threaded_blas() -> contextlib.AbstractContextManager[Any]:
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        log.info("threadpoolctl missing: BLAS keeps its default thread count")
        return contextlib.nullcontext()
    limits: contextlib.AbstractContextManager[Any] = threadpool_limits(1, "blas")
    return limits


def _host(a: Any) -> Any:
    return a.get() if hasattr(a, "get") else a
