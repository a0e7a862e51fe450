"""The node's instance budget: at most ``limit`` instances across all functions at once (standby
instances included: Note [standby instances] in trims.runtime.gateway.pool).

A pool asks :meth:`InstanceBudget.try_start` before starting an instance. Under the limit the
answer is yes. At the limit, the least recently used idle instance of any function is stopped to
make room (unless one is already stopping) and the answer is no for now: when that instance is
gone, and whenever an instance somewhere becomes idle, the budget tells every pool with queued
requests to try again. Draining instances still count: their memory is free only once they exit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class BudgetedPool(Protocol):
    def instance_total(self) -> int: ...

    def instance_draining(self) -> int: ...

    def idle_since(self) -> float | None:
        """When its least recently used idle ready instance was last used; None if none."""
        ...

    def evict_idle(self) -> None:
        """Stop its least recently used idle ready instance."""
        ...

    def drop_standby(self) -> bool:
        """Stop one of its standby instances; False if it has none."""
        ...

    def wants_instances(self) -> bool: ...

    def retry_scale_up(self) -> None: ...


class InstanceBudget:
    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._pools: list[BudgetedPool] = []

    def register(self, pool: BudgetedPool) -> None:
        self._pools.append(pool)

    def unregister(self, pool: BudgetedPool) -> None:
        if pool in self._pools:
            self._pools.remove(pool)

    def total(self) -> int:
        return sum(p.instance_total() for p in self._pools)

    def has_room(self) -> bool:
        """Is the node under its limit (a standby may start; nothing is evicted for it)?"""
        return self.limit is None or self.total() < self.limit

    def try_start(self) -> bool:
        """May one more instance start now? At the limit, drops a standby (any function's)
        or else evicts an idle instance for later."""
        if self.has_room():
            return True
        if any(p.instance_draining() for p in self._pools):
            return False  # room is already being made; evicting more would overshoot
        if any(p.drop_standby() for p in self._pools):
            return False
        victim = _least_recently_used(self._pools)
        if victim is not None:
            victim.evict_idle()
        return False

    def capacity_changed(self) -> None:
        """An instance stopped or became idle: pools with queued requests may now scale."""
        if self.limit is None:
            return
        for pool in list(self._pools):
            if pool.wants_instances():
                pool.retry_scale_up()


def _least_recently_used(pools: Iterable[BudgetedPool]) -> BudgetedPool | None:
    best: BudgetedPool | None = None
    best_at = float("inf")
    for pool in pools:
        at = pool.idle_since()
        if at is not None and at < best_at:
            best, best_at = pool, at
    return best
