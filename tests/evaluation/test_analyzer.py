"""Critical path (parallel lower bound) on hand-made DAGs."""

from __future__ import annotations

import pytest

from trims.evaluation.analyzer import critical_path


def test_chain_is_the_sum() -> None:
    assert critical_path([1.0, 2.0, 3.0], [[], [0], [1]]) == (6.0, [0, 1, 2])


def test_diamond_takes_the_longer_branch() -> None:
    #   0 -> 1 (5) -> 3
    #   0 -> 2 (2) -> 3
    length, path = critical_path([1.0, 5.0, 2.0, 1.0], [[], [0], [0], [1, 2]])
    assert length == 7.0
    assert path == [0, 1, 3]


def test_independent_branches_and_late_join() -> None:
    # two chains 0->1 (3+3) and 2->3->4 (1+1+1) joined at 5
    weights = [3.0, 3.0, 1.0, 1.0, 1.0, 0.5]
    preds = [[], [0], [], [2], [3], [1, 4]]
    length, path = critical_path(weights, preds)
    assert length == 6.5
    assert path == [0, 1, 5]
    assert length <= sum(weights)


def test_empty_graph() -> None:
    assert critical_path([], []) == (0.0, [])


def test_rejects_non_topological_order() -> None:
    with pytest.raises(ValueError, match="topological"):
        critical_path([1.0, 1.0], [[1], []])
