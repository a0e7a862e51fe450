"""Accuracy metrics on hand-made cases whose answers are worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from trims.errors import ValidationError
from trims.evaluation.harness import accuracy


def test_top1_and_top5_on_hand_made_scores() -> None:
    scores = np.array(
        [
            [0.1, 0.7, 0.2, 0.0, 0.0, 0.0],  # best 1
            [0.5, 0.1, 0.4, 0.0, 0.0, 0.0],  # best 0, label 2 second
            [0.0, 0.0, 0.0, 0.1, 0.2, 0.7],  # label 0 is last but tied at 0.0 with 1 and 2
            [0.3, 0.3, 0.1, 0.1, 0.1, 0.1],  # tie: lower index (0) wins
        ]
    )
    labels = [1, 2, 0, 1]
    assert accuracy.top_k_accuracy(scores, labels, 1) == 0.25
    assert accuracy.top_k_accuracy(scores, labels, 2) == 0.75
    # top-5 of row 2 is 5, 4, 3, 0, 1 (stable ties): label 0 is in
    assert accuracy.top_k_accuracy(scores, labels, 5) == 1.0
    assert accuracy.score("top1", scores, labels) == 0.25
    assert accuracy.top_k(scores, 3)[3].tolist() == [0, 1, 2]


def test_top_k_refuses_mismatched_input() -> None:
    with pytest.raises(ValidationError, match="2 score rows for 3 labels"):
        accuracy.top_k_accuracy(np.zeros((2, 3)), [0, 1, 2])
    with pytest.raises(ValidationError, match=r"\[samples, classes\]"):
        accuracy.top_k(np.zeros(3), 1)
    with pytest.raises(ValidationError, match="no samples"):
        accuracy.top_k_accuracy(np.zeros((0, 3)), [])


def test_spearman_with_ties_matches_the_pearson_of_average_ranks() -> None:
    assert accuracy.spearman(np.array([1, 2, 3, 4]), np.array([10, 20, 30, 40])) == 1.0
    assert accuracy.spearman(np.array([1, 2, 3, 4]), np.array([4, 3, 2, 1])) == -1.0
    # ranks of b with a tie: [1, 2.5, 2.5, 4]; pearson with [1, 2, 3, 4] = 4.5 / sqrt(5 * 4.5)
    rho = accuracy.spearman(np.array([1, 2, 3, 4]), np.array([1, 5, 5, 9]))
    assert rho == pytest.approx(4.5 / np.sqrt(5 * 4.5))


def test_cosine_spearman() -> None:
    left = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    right = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])  # cosines 1, 0.707, 0
    assert accuracy.cosine_spearman(left, right, [5.0, 3.0, 0.5]) == 1.0
    assert accuracy.cosine_spearman(left, right, [0.0, 3.0, 5.0]) == -1.0
    assert accuracy.score("cosine_spearman", (left, right), [5.0, 3.0, 0.5]) == 1.0


def test_precision_at_k() -> None:
    recommended = [[3, 1, 4, 0], [2, 7, 8, 9], [5, 6, 1, 2]]
    relevant = [{1, 4}, {9}, set()]  # the third user has nothing held out: not counted
    # top-2: user 0 hits 1 of [3, 1] -> 0.5, user 1 hits none of [2, 7] -> 0.0
    assert accuracy.precision_at_k(recommended, relevant, 2) == 0.25
    # top-4: user 0 hits 1 and 4 -> 0.5, user 1 hits 9 -> 0.25
    assert accuracy.precision_at_k(recommended, relevant, 4) == 0.375
    assert accuracy.score("precision_at_k", recommended, relevant, k=4) == 0.375
    with pytest.raises(ValidationError, match="no user has a relevant item"):
        accuracy.precision_at_k([[1]], [set()], 1)
    with pytest.raises(ValidationError, match="unknown metric 'f1'"):
        accuracy.score("f1", [], [])
