"""Byte budgets per tier and the choice of what to evict when a load does not fit.

A :class:`TierLedger` counts the bytes of the resident copies of one tier plus the bytes
reserved by loads in flight, so two concurrent loads cannot both fit into the same free space.
:func:`choose_victims` picks, by policy, the fewest evictable copies that free enough bytes;
a copy with live leases or a pin is never evictable (see Note [lease keeps memory alive]).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from trims.config import format_size
from trims.daemon.settings import EVICTION_POLICIES
from trims.errors import ResourceExhausted, ValidationError


@dataclass
class Resident:
    """One model copy resident in a tier, with the usage figures the policies rank by."""

    digest: str
    size: int
    loaded_at: float
    last_used: float
    uses: int = 0

    def touch(self) -> None:
        self.last_used = time.monotonic()
        self.uses += 1


_RANK: dict[str, Callable[[Resident], tuple[float, ...]]] = {
    "lru": lambda r: (r.last_used, r.loaded_at),
    "lfu": lambda r: (float(r.uses), r.last_used),
    "fifo": lambda r: (r.loaded_at,),
}


class TierLedger:
    """Resident copies and reserved bytes of one tier, within its budget."""

    def __init__(self, tier: str, budget: int, policy: str) -> None:
        if policy not in EVICTION_POLICIES:
            raise ValidationError(
                f"unknown eviction policy {policy!r} for tier {tier}; use one of "
                f"{EVICTION_POLICIES}"
            )
        self.tier = tier
        self.budget = budget
        self.policy = policy
        self.residents: dict[str, Resident] = {}
        self.reserved = 0

    @property
    def used(self) -> int:
        return sum(r.size for r in self.residents.values())

    @property
    def committed(self) -> int:
        return self.used + self.reserved

    def add(self, digest: str, size: int) -> Resident:
        now = time.monotonic()
        resident = Resident(digest, size, loaded_at=now, last_used=now)
        self.residents[digest] = resident
        return resident

    def plan(self, size: int, evictable: Callable[[Resident], bool]) -> list[Resident]:
        """The residents to evict so ``size`` more bytes fit; ResourceExhausted if impossible."""
        if self.budget <= 0:
            raise ResourceExhausted(
                f"the {self.tier} tier is disabled (budget 0); start the daemon with "
                f"--{self.tier}-budget to use it",
                tier=self.tier,
                reason="disabled",
                budget=self.budget,
                needed=size,
            )
        free = self.budget - self.committed
        if size <= free:
            return []
        victims = choose_victims(self.residents.values(), self.policy, size - free, evictable)
        if victims is None:
            raise ResourceExhausted(
                f"the {self.tier} tier cannot fit {format_size(size)}: budget "
                f"{format_size(self.budget)}, {format_size(self.committed)} in use or loading, "
                f"and not enough of it is evictable (policy {self.policy}; leased or pinned "
                "models stay); release leases, unpin models or raise the budget",
                tier=self.tier,
                reason="budget",
                budget=self.budget,
                needed=size,
                used=self.committed,
            )
        return victims


def choose_victims(
    residents: Iterable[Resident],
    policy: str,
    needed: int,
    evictable: Callable[[Resident], bool],
) -> list[Resident] | None:
    """Residents to evict, in policy order, freeing at least ``needed`` bytes; None if none do."""
    return enough(ranked(residents, policy, evictable), needed)


def enough(candidates: Iterable[Resident], needed: float) -> list[Resident] | None:
    """The shortest prefix of ``candidates`` whose sizes add up to ``needed``; None if all of
    them together do not."""
    chosen: list[Resident] = []
    freed = 0
    for r in candidates:
        if freed >= needed:
            break
        chosen.append(r)
        freed += r.size
    return chosen if freed >= needed else None


def ranked(
    residents: Iterable[Resident], policy: str, evictable: Callable[[Resident], bool]
) -> list[Resident]:
    """The evictable residents, the first to go first by ``policy`` (none under "never")."""
    if policy == "never":
        return []
    return sorted((r for r in residents if evictable(r)), key=_RANK[policy])
