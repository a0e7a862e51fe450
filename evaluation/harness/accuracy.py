"""Accuracy metrics of the evaluation manifests, in NumPy: top-k, cosine/Spearman, precision@k.

Each returns a fraction in [0, 1] (Spearman's rho lies in [-1, 1]; a useful embedding model has
it above 0). Ties are broken the way NumPy's stable argsort breaks them: the lower index wins,
so a metric is a deterministic function of its inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from trims.errors import ValidationError

__all__ = ["cosine_spearman", "precision_at_k", "score", "spearman", "top_k", "top_k_accuracy"]


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` highest scores per row, best first ([N, k]); ties: lower index."""
    scores = np.asarray(scores)
    if scores.ndim != 2:
        raise ValidationError(f"scores must be [samples, classes], got shape {scores.shape}")
    k = min(k, scores.shape[1])
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def top_k_accuracy(scores: np.ndarray, labels: Sequence[int] | np.ndarray, k: int = 1) -> float:
    """The fraction of samples whose label is among the ``k`` highest scores."""
    labels = np.asarray(labels, dtype=np.int64)
    if len(labels) == 0:
        raise ValidationError("no samples to score")
    if len(labels) != len(scores):
        raise ValidationError(f"{len(scores)} score rows for {len(labels)} labels")
    hits = (top_k(scores, k) == labels[:, None]).any(axis=1)
    return float(hits.mean())


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or len(a) < 2:
        raise ValidationError("spearman needs two 1-D sequences of the same length >= 2")
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = float(np.sqrt((ra * ra).sum() * (rb * rb).sum()))
    return 0.0 if denom == 0 else float((ra * rb).sum() / denom)


def cosine_spearman(left: np.ndarray, right: np.ndarray, gold: Sequence[float]) -> float:
    """Spearman's rho between the cosine similarity of each embedding pair and the gold score
    (the STS benchmark's measure)."""
    left, right = np.asarray(left, dtype=np.float64), np.asarray(right, dtype=np.float64)
    norms = np.linalg.norm(left, axis=1) * np.linalg.norm(right, axis=1)
    cos = (left * right).sum(axis=1) / np.where(norms == 0, 1.0, norms)
    return spearman(cos, np.asarray(gold, dtype=np.float64))


def precision_at_k(
    recommended: np.ndarray | Sequence[Sequence[int]],
    relevant: Sequence[Any],
    k: int,
) -> float:
    """Mean over users with at least one relevant item of |top-k recommended ∩ relevant| / k."""
    if k < 1:
        raise ValidationError(f"k must be >= 1, got {k}")
    if len(recommended) != len(relevant):
        raise ValidationError(f"{len(recommended)} recommendation lists for {len(relevant)} users")
    total, users = 0.0, 0
    for recs, rel in zip(recommended, relevant, strict=True):
        wanted = {int(i) for i in rel}
        if not wanted:
            continue
        top = [int(i) for i in list(recs)[:k]]
        total += len(wanted.intersection(top)) / k
        users += 1
    if users == 0:
        raise ValidationError("no user has a relevant item")
    return total / users


def score(metric: str, predictions: Any, labels: Any, k: int | None = None) -> float:
    """One manifest metric: top1/top5 (scores, labels), precision_at_k (ranked lists, relevant
    sets), cosine_spearman ((left, right) embeddings, gold scores)."""
    if metric == "top1":
        return top_k_accuracy(predictions, labels, 1)
    if metric == "top5":
        return top_k_accuracy(predictions, labels, 5)
    if metric == "precision_at_k":
        return precision_at_k(predictions, labels, k or 10)
    if metric == "cosine_spearman":
        left, right = predictions
        return cosine_spearman(left, right, labels)
    raise ValidationError(f"unknown metric {metric!r}")


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(1, len(x) + 1)
    values, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    if len(values) != len(x):
        sums = np.zeros(len(values))
        np.add.at(sums, inverse, ranks)
        ranks = (sums / counts)[inverse]
    return ranks
