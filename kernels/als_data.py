"""Rating data for the ALS study: MovieLens-100k from the recbole wheel, a synthetic generator.

MovieLens-100k is read at run time from the example bundled in the ``recbole`` package
(``recbole/dataset_example/ml-100k/ml-100k.inter``); the data is never copied into this
repository. Install it with ``pip install --no-deps recbole`` (only its data file is used, so its
dependencies are not needed).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from trims.errors import NotFound, ValidationError

log = logging.getLogger(__name__)

ML100K_RELATIVE = Path("dataset_example/ml-100k/ml-100k.inter")
INSTALL_HINT = "install it with: pip install --no-deps recbole"


@dataclass(frozen=True)
class Ratings:
    """(user, item, rating) triples with dense 0-based ids."""

    users: npt.NDArray[np.int64]
    items: npt.NDArray[np.int64]
    ratings: npt.NDArray[np.float64]
    n_users: int
    n_items: int
    name: str

    def __len__(self) -> int:
        return int(self.users.size)

    def subset(self, mask: npt.NDArray[np.bool_]) -> Ratings:
        return Ratings(
            self.users[mask], self.items[mask], self.ratings[mask], self.n_users, self.n_items,
            self.name,
        )  # fmt: skip


def ml100k_path() -> Path:
    """Where the installed recbole keeps ml-100k.inter, or NotFound saying how to install it."""
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise NotFound(f"MovieLens-100k comes from the recbole package, which is not installed; "
                       f"{INSTALL_HINT}")  # fmt: skip
    for root in spec.submodule_search_locations:
        path = Path(root) / ML100K_RELATIVE
        if path.is_file():
            return path
    raise NotFound(f"recbole is installed but has no {ML100K_RELATIVE}; reinstall it: "
                   f"pip install --no-deps --force-reinstall recbole")  # fmt: skip


def load_ml100k(path: Path | None = None) -> Ratings:
    """Parse ml-100k.inter (tab-separated with a typed header line) into dense ids."""
    path = path or ml100k_path()
    try:
        raw = np.loadtxt(path, delimiter="\t", skiprows=1, usecols=(0, 1, 2), dtype=np.float64)
    except (OSError, ValueError) as e:
        raise ValidationError(f"cannot parse {path} as MovieLens .inter: {e}") from e
    raw = raw.reshape(-1, 3)
    users, uid = np.unique(raw[:, 0].astype(np.int64), return_inverse=True)
    items, iid = np.unique(raw[:, 1].astype(np.int64), return_inverse=True)
    log.info("ml-100k read from %s: %d ratings, %d users, %d items", path, len(raw),
             users.size, items.size)  # fmt: skip
    return Ratings(uid.astype(np.int64), iid.astype(np.int64), raw[:, 2].copy(), users.size,
                   items.size, "ml-100k")  # fmt: skip


def synthetic(
    n_users: int, n_items: int, per_user: float = 20.0, seed: int = 0, rank: int = 8
) -> Ratings:
    """Power-law ratings: user activity and item popularity are Zipf-like; ratings 1..5 come
    from a hidden low-rank model plus noise, so ALS has structure to find."""
    rng = np.random.default_rng(seed)
    activity = rng.pareto(1.2, n_users) + 1.0
    counts = np.maximum(1, (activity / activity.mean() * per_user).astype(np.int64))
    counts = np.minimum(counts, n_items)
    popularity = 1.0 / np.arange(1, n_items + 1) ** 0.8
    popularity /= popularity.sum()
    users = np.repeat(np.arange(n_users, dtype=np.int64), counts)
    items = rng.choice(n_items, size=users.size, p=popularity).astype(np.int64)
    pairs = np.unique(users * n_items + items)
    users, items = pairs // n_items, pairs % n_items
    u = rng.normal(0, 1, (n_users, rank))
    v = rng.normal(0, 1, (n_items, rank))
    score = (u[users] * v[items]).sum(1) / np.sqrt(rank) + rng.normal(0, 0.5, users.size)
    ratings = np.clip(np.round(3.0 + score), 1, 5)
    return Ratings(users, items, ratings, n_users, n_items, f"synthetic-{n_users}x{n_items}")


def split(data: Ratings, test_fraction: float = 0.2, seed: int = 0) -> tuple[Ratings, Ratings]:
    """Fixed random split of the ratings (same seed, same split)."""
    rng = np.random.default_rng(seed)
    test = rng.random(len(data)) < test_fraction
    return data.subset(~test), data.subset(test)
