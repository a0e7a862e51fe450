"""The node's instance budget: instances across all functions are capped by count (at most
``limit``, standby instances included: Note [standby instances] in
trims.runtime.gateway.pool) and, where a memory cgroup limits the gateway, by memory
(Note [memory admission]).

A pool asks :meth:`InstanceBudget.try_start` before starting an instance. With room the answer
is :attr:`Admission.START`. Without, room is made: a standby of any function is dropped, else
the least recently used idle instance of any function is stopped (unless one is already
stopping), and the answer is :attr:`Admission.WAIT`: when that instance is gone, and whenever
an instance somewhere becomes idle, the budget tells every pool with queued requests to try
again. Draining instances still count: their memory is free only once they exit.

Note [memory admission]: an instance may start while the cgroup's working set plus the
expected cost of every instance still starting (their memory is not charged yet) and of the
new one stays at or under ``watermark`` of the limit (:mod:`trims.runtime.gateway.memory`).
The expected cost is the median private memory measured of the function's own instances,
else of every function's, else :data:`UNMEASURED_INSTANCE_BYTES`. Short of memory with
nothing to free (no standby, no idle instance, none draining), the answer is
:attr:`Admission.REFUSE`: a request that no instance of its function can serve is refused with
503 and ``Retry-After`` rather than starting an instance that would have the kernel OOM-kill a
process of the node. (At the count limit alone a request waits instead: an instance becoming
idle is room, whereas memory may stay short.) An instance with a request in flight is never
idle, so making room never fails a request.

Note [starts refused for capacity]: the budget sees the gateway's memory, not the model
store's. A start the budget admitted can still be refused by the store (its cpu tier cannot
fit the function's model while other instances' leases keep theirs resident): the worker's
init fails with ``resource_exhausted``, which is no fault of the function. The pool then asks
:meth:`InstanceBudget.make_room`, which stops a standby or the coldest idle instance of any
function the same way (their leases end with their processes), and waits: once nothing is
draining any more, :meth:`InstanceBudget.capacity_changed` has the pool retry its start. With
nothing to stop, the requests no instance of the function can serve get 503 with
``Retry-After``.
"""

from __future__ import annotations

import enum
import logging
import statistics
from collections.abc import Iterable
from typing import Protocol

from trims.runtime.gateway.memory import MemoryReading, MemorySource, cgroup_memory
from trims.runtime.settings import GatewaySettings

__all__ = [
    "UNMEASURED_INSTANCE_BYTES",
    "Admission",
    "BudgetedPool",
    "InstanceBudget",
    "node_budget",
]

log = logging.getLogger(__name__)

#: What an instance is expected to cost before any was measured: a forked worker with numpy
#: costs ~20 MiB of its own, one that imported torch and ran a model more.
UNMEASURED_INSTANCE_BYTES = 64 << 20


class Admission(enum.Enum):
    START = "start"
    #: Room is being made, or an instance will become idle: ask again on capacity_changed.
    WAIT = "wait"
    #: Memory is short and nothing can be freed: refuse what no running instance can serve.
    REFUSE = "refuse"


class BudgetedPool(Protocol):
    name: str

    def instance_total(self) -> int: ...

    def instance_draining(self) -> int: ...

    def instance_starting(self) -> int:
        """Instances started or being prepared whose memory is not yet charged in full."""
        ...

    def instance_memory(self) -> int | None:
        """The median private memory measured of its recent instances; None if none was."""
        ...

    def idle_since(self) -> float | None:
        """When its least recently used idle ready instance was last used; None if none."""
        ...

    def evict_idle(self, reason: str) -> None:
        """Stop its least recently used idle ready instance (``reason``: the metric's)."""
        ...

    def holds_models(self) -> bool:
        """Whether its instances lease models from the store (stopping one frees store room)."""
        ...

    def drop_standby(self, reason: str) -> bool:
        """Stop one of its standby instances; False if it has none."""
        ...

    def wants_instances(self) -> bool: ...

    def retry_scale_up(self) -> None: ...


class InstanceBudget:
    def __init__(
        self, limit: int | None, memory: MemorySource | None = None, *, watermark: float = 0.9
    ) -> None:
        self.limit = limit
        #: Reads the cgroup's memory; None: instances are not capped by memory.
        self.memory = memory
        #: The share of the memory limit that usage plus new instances may reach.
        self.watermark = watermark
        self._pools: list[BudgetedPool] = []
        #: Pools whose start was refused for capacity, waiting for room being made (Note
        #: [starts refused for capacity]).
        self._awaiting_room: list[BudgetedPool] = []

    @property
    def bounded(self) -> bool:
        """Whether anything caps the instances (else every start is admitted)."""
        return self.limit is not None or self.memory is not None

    def register(self, pool: BudgetedPool) -> None:
        self._pools.append(pool)

    def unregister(self, pool: BudgetedPool) -> None:
        if pool in self._pools:
            self._pools.remove(pool)
        if pool in self._awaiting_room:
            self._awaiting_room.remove(pool)

    def total(self) -> int:
        return sum(p.instance_total() for p in self._pools)

    def has_room(self, pool: BudgetedPool | None = None) -> bool:
        """Is the node under its limits (a standby of ``pool`` may start; nothing is evicted
        for it)?"""
        if self.limit is not None and self.total() >= self.limit:
            return False
        return not self._memory_short(pool)

    def try_start(self, pool: BudgetedPool | None = None) -> Admission:
        """May one more instance (of ``pool``) start now? Without room, drops a standby (any
        function's) or else evicts an idle instance, for later (Note [memory admission])."""
        at_count = self.limit is not None and self.total() >= self.limit
        short = not at_count and self._memory_short(pool)
        if not at_count and not short:
            return Admission.START
        if self._draining():
            return Admission.WAIT  # room is already being made; evicting more would overshoot
        if self._stop_one("count_limit" if at_count else "memory_pressure", self._pools):
            return Admission.WAIT
        return Admission.REFUSE if short else Admission.WAIT

    def make_room(self, pool: BudgetedPool, reason: str) -> bool:
        """``pool``'s start was refused for capacity in the store (``reason``: the stop
        metric's label): stop a standby or the coldest idle instance of any function that
        leases models unless room is already being made, and have ``pool`` retry once nothing
        is draining (Note [starts refused for capacity]). False: nothing can be stopped."""
        holders = [p for p in self._pools if p.holds_models()]
        if not self._draining() and not self._stop_one(reason, holders):
            return False
        if pool not in self._awaiting_room:
            self._awaiting_room.append(pool)
        return True

    def awaiting_room(self, pool: BudgetedPool) -> bool:
        """Is ``pool`` waiting for room being made (its starts wait until then)?"""
        return pool in self._awaiting_room

    def capacity_changed(self) -> None:
        """An instance stopped or became idle: pools with queued requests may now scale, and
        once nothing is draining, so may those waiting for room."""
        released: list[BudgetedPool] = []
        if self._awaiting_room and not self._draining():
            released, self._awaiting_room = self._awaiting_room, []
        for pool in released:
            if pool.wants_instances():
                pool.retry_scale_up()
        if not self.bounded:
            return
        for pool in list(self._pools):
            if pool not in released and not self.awaiting_room(pool) and pool.wants_instances():
                pool.retry_scale_up()

    def instance_cost(self, pool: BudgetedPool | None) -> int:
        """The memory one more instance of ``pool`` is expected to take, bytes."""
        own = pool.instance_memory() if pool is not None else None
        if own is not None:
            return own
        measured = [m for p in self._pools if (m := p.instance_memory()) is not None]
        return int(statistics.median(measured)) if measured else UNMEASURED_INSTANCE_BYTES

    def memory_state(self) -> tuple[float, bool] | None:
        """(working set / limit, whether at or above the watermark); None without a limit."""
        reading = self.memory() if self.memory is not None else None
        if reading is None:
            return None
        ratio = reading.usage_bytes / reading.limit_bytes
        return ratio, ratio >= self.watermark

    def _draining(self) -> bool:
        return any(p.instance_draining() for p in self._pools)

    def _stop_one(self, reason: str, pools: list[BudgetedPool]) -> bool:
        """Drop a standby of any of ``pools``, else stop the least recently used idle instance
        of any of them; False if there is neither."""
        if any(p.drop_standby(reason) for p in pools):
            return True
        victim = _least_recently_used(pools)
        if victim is None:
            return False
        victim.evict_idle(reason)
        return True

    def _memory_short(self, pool: BudgetedPool | None) -> bool:
        reading = self.memory() if self.memory is not None else None
        if reading is None:
            return False
        starting = sum(p.instance_starting() for p in self._pools)
        need = self.instance_cost(pool) * (starting + 1)
        return reading.usage_bytes + need > self.watermark * reading.limit_bytes


def node_budget(settings: GatewaySettings, source: MemorySource = cgroup_memory) -> InstanceBudget:
    """The gateway's budget: ``--max-instances-total`` and, where ``source`` finds a memory
    limit at start and ``--memory-high-watermark`` is not off, that limit."""
    reading: MemoryReading | None = None
    if settings.memory_high_watermark is not None:
        reading = source()
    if reading is None:
        return InstanceBudget(settings.max_instances_total)
    watermark = settings.memory_high_watermark
    assert watermark is not None
    log.info(
        "memory limit %s: instances start while the node's memory stays under %s (%g of it); "
        "beyond, idle instances are stopped and requests refused with 503",
        _mib(reading.limit_bytes), _mib(int(watermark * reading.limit_bytes)), watermark,
    )  # fmt: skip
    return InstanceBudget(settings.max_instances_total, source, watermark=watermark)


def _least_recently_used(pools: Iterable[BudgetedPool]) -> BudgetedPool | None:
    best: BudgetedPool | None = None
    best_at = float("inf")
    for pool in pools:
        at = pool.idle_since()
        if at is not None and at < best_at:
            best, best_at = pool, at
    return best


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"
