"""Victim choice and budget ledger, in-process (the policies' rules, without a daemon)."""

from __future__ import annotations

import pytest

from trims.daemon.eviction import Resident, TierLedger, choose_victims
from trims.errors import ResourceExhausted, ValidationError


def _residents() -> list[Resident]:
    # digest, size, loaded_at, last_used, uses
    return [
        Resident("a", 100, loaded_at=1, last_used=9, uses=5),
        Resident("b", 100, loaded_at=2, last_used=5, uses=1),
        Resident("c", 300, loaded_at=3, last_used=7, uses=2),
    ]


@pytest.mark.parametrize(
    ("policy", "needed", "victims"),
    [
        ("lru", 50, ["b"]),
        ("lru", 150, ["b", "c"]),
        ("lfu", 150, ["b", "c"]),
        ("lfu", 50, ["b"]),
        ("fifo", 50, ["a"]),
        ("fifo", 150, ["a", "b"]),
        ("never", 50, None),
        ("never", 0, []),
        ("lru", 600, None),
    ],
)
def test_choose_victims(policy: str, needed: int, victims: list[str] | None) -> None:
    chosen = choose_victims(_residents(), policy, needed, lambda r: True)
    assert (None if chosen is None else [r.digest for r in chosen]) == victims


def test_unevictable_residents_are_skipped() -> None:
    chosen = choose_victims(_residents(), "lru", 150, lambda r: r.digest != "b")
    assert chosen is not None and [r.digest for r in chosen] == ["c"]


def test_ledger_counts_reservations_and_names_the_shortfall() -> None:
    ledger = TierLedger("cpu", 1000, "lru")
    ledger.add("a", 400)
    ledger.reserved = 500
    assert ledger.plan(100, lambda r: True) == []
    assert [r.digest for r in ledger.plan(200, lambda r: True)] == ["a"]
    with pytest.raises(ResourceExhausted) as info:
        ledger.plan(200, lambda r: False)
    assert info.value.details == {
        "tier": "cpu",
        "reason": "budget",
        "budget": 1000,
        "needed": 200,
        "used": 900,
    }
    with pytest.raises(ResourceExhausted, match="disabled"):
        TierLedger("gpu", 0, "lru").plan(1, lambda r: True)
    with pytest.raises(ValidationError):
        TierLedger("cpu", 1, "random")
