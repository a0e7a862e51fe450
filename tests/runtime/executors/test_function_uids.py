"""Note [one uid per function]: how a container executor picks each function's uid (pure)."""

from __future__ import annotations

import pytest

from trims.errors import Unavailable, ValidationError
from trims.runtime.executors.function_uids import (
    DEFAULT_UID_BASE,
    DEFAULT_UID_COUNT,
    FunctionUids,
    check_uid_range,
    function_uid,
)


def test_a_functions_uid_comes_from_its_name_and_stays_in_the_range() -> None:
    uids = {
        name: function_uid(name, DEFAULT_UID_BASE, DEFAULT_UID_COUNT, held={})
        for name in ("echo", "resnet", "bert", "hog")
    }
    assert len(set(uids.values())) == len(uids)
    assert all(DEFAULT_UID_BASE <= u < DEFAULT_UID_BASE + DEFAULT_UID_COUNT for u in uids.values())
    assert function_uid("echo", DEFAULT_UID_BASE, DEFAULT_UID_COUNT, held={}) == uids["echo"]


def test_a_held_or_reserved_uid_is_probed_past_wrapping_in_the_range() -> None:
    base, count = 1000, 3
    first = function_uid("a", base, count, held={})
    following = base + (first - base + 1) % count
    assert function_uid("b", base, count, held={first: "a"}) != first
    assert function_uid("b", base, count, held={}, reserved={first}) != first
    # "a" keeps the uid it holds, even a reserved one, and shares it among its instances
    assert function_uid("a", base, count, held={following: "a"}, reserved={following}) == following
    taken = {base: "x", base + 1: "y"}
    assert function_uid("z", base, count, held=taken) == base + 2
    with pytest.raises(Unavailable, match="raise uid_count"):
        function_uid("z", base, count, held=taken, reserved={base + 2})


def test_two_functions_starting_at_once_never_share_a_uid() -> None:
    """The uid of a start in progress is held before the executor tracks the instance."""
    uids = FunctionUids(5000, 2)
    with uids.starting("a", "a-1", running=[]) as a, uids.starting("b", "b-1", running=[]) as b:
        assert a != b
        with uids.starting("a", "a-2", running=[]) as a2:
            assert a2 == a
        with pytest.raises(Unavailable):
            uids.uid_for("c", running=[])
    # nothing is held once the starts are over: the executor's instances say what runs
    assert uids.uid_for("c", running=[("a", a)]) == b


@pytest.mark.parametrize(
    ("base", "count", "error"),
    [(0, 10, "at least 1"), (10, 0, "at least 1"), (2**32 - 5, 10, "largest uid")],
)
def test_a_range_with_root_or_past_the_largest_uid_is_refused(
    base: int, count: int, error: str
) -> None:
    with pytest.raises(ValidationError, match=error):
        check_uid_range(base, count, "docker executor")
