"""Memory pressure: unleased CPU-tier copies move down to the disk tier before the kernel
OOM-kills a process of the node.

Note [memory pressure]
~~~~~~~~~~~~~~~~~~~~~~
The CPU tier's budget is fixed at start (half the limit by default: trims.daemon.settings), but
the daemon's memory cgroup is often shared: ``trims up``, one container or a benchmark's
cgroup also hold the gateway and the function instances, whose memory grows with traffic. The
kernel compares the cgroup's whole charge with the limit, so the daemon watches that too, as
its working set (usage less inactive file pages, which the kernel reclaims before it kills
anything: :attr:`trims.cgroup.MemoryCgroup.working_set_bytes`)::

    limit ──────────────────────────  the kernel OOM-kills a process of the cgroup
    high  (--memory-high-watermark, 0.9)
          a check finds the working set here or above: unleased CPU-tier copies are demoted,
          in the tier's eviction order (LRU by default), until it is under low (or none is
          left); a load into the CPU tier that would take it past high demotes the same way
          first, and where that cannot make room the load is refused (ResourceExhausted)
    low   (--memory-low-watermark, 0.8)
          demotion stops here: the gap keeps a check from demoting one copy per second while
          the other processes grow

Demoting is the CPU tier's eviction: the copy leaves memory, the layout stays in the disk tier
and the next acquire loads it back. (A page-cache copy's pages, unlocked, join the inactive
file pages: still charged, no longer in the working set, reclaimed before any kill.) A copy
with a live lease or a pin is never demoted (Note [lease keeps memory alive]); under the
"never" policy none is. With nothing left to demote the pressure stays and loads into the CPU
tier are refused, naming what was asked, the limit and what is held: a refused acquire can be
retried, whereas an OOM kill of the daemon would end every lease on the node.

When: at each load into the CPU tier (the daemon's own growth, checked before it happens) and
on a tick every ``memory_check_interval`` (1 s; the other processes' growth). A check reads a
few small /proc and cgroup files (about 0.25 ms on our 2-core machine). Notifications would
save the tick but exist only in part: v1's usage thresholds need write access to
``cgroup.event_control`` (a container usually lacks it), and v2 signals nothing below
``memory.max`` unless ``memory.high`` is set, which throttles the whole cgroup; one poll works
the same on both.

Only where a cgroup limits the daemon below the machine's memory: otherwise the machine's other
processes share that memory and the cgroup's charge says nothing about how close a kill is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trims.cgroup import mem_total, memory_cgroup
from trims.config import format_size
from trims.daemon.eviction import Resident, TierLedger, enough, ranked
from trims.errors import ResourceExhausted

__all__ = ["MemoryPressure", "MemoryReading", "MemorySource", "Relief", "cgroup_memory"]


@dataclass(frozen=True)
class MemoryReading:
    """The daemon's cgroup's memory now, bytes."""

    #: Usage less inactive file pages.
    working_set_bytes: int
    #: The effective limit (the smallest of the cgroup's and its ancestors').
    limit_bytes: int

    @property
    def share(self) -> float:
        """The working set as a share of the limit, as the watermarks are."""
        return self.working_set_bytes / self.limit_bytes


#: Reads the memory now; None where no cgroup limits the daemon (nothing is demoted then).
MemorySource = Callable[[], MemoryReading | None]


def cgroup_memory() -> MemoryReading | None:
    """This process's memory cgroup, where its limit is below the machine's memory."""
    memory, total = memory_cgroup(), mem_total()
    limit, working_set = memory.limit_bytes, memory.working_set_bytes
    if limit is None or working_set is None or total is None or limit >= total:
        return None
    return MemoryReading(working_set, limit)


@dataclass(frozen=True)
class Relief:
    """What a check found and what it demotes."""

    reading: MemoryReading
    #: Copies to demote, first to go first.
    victims: list[Resident]
    #: Copies that stay although memory is short: leased or pinned (or the policy is never).
    held: list[Resident]


class MemoryPressure:
    """The watermarks over one memory source, and which copies of a tier leave for them."""

    def __init__(self, source: MemorySource, high: float, low: float) -> None:
        self.source = source
        self.high = high
        self.low = low
        #: Between a reading at or above high and the next one under low.
        self.pressed = False

    def check(self, ledger: TierLedger, evictable: Callable[[Resident], bool]) -> Relief | None:
        """A tick's check: at or above high, the copies to demote to bring the working set
        under low (every evictable one where they do not suffice); None while no limit is
        known or the working set is under high."""
        reading = self.source()
        if reading is None:
            self.pressed = False
            return None
        self._note(reading)
        if reading.share < self.high:
            return None
        # a byte past the low watermark: at it the pressure would not end
        needed = reading.working_set_bytes - int(self.low * reading.limit_bytes) + 1
        candidates = ranked(ledger.residents.values(), ledger.policy, evictable)
        victims = enough(candidates, needed) or candidates
        leaving = {r.digest for r in candidates}
        held = [r for r in ledger.residents.values() if r.digest not in leaving]
        return Relief(reading, victims, held)

    def after(self, reading: MemoryReading | None) -> None:
        """A reading taken after demotions: the pressure ends once it is under low."""
        if reading is not None:
            self._note(reading)

    def room_for(
        self,
        size: int,
        ledger: TierLedger,
        evictable: Callable[[Resident], bool],
        freed: list[Resident],
        label: str,
    ) -> list[Resident]:
        """The copies to demote, beside ``freed`` (leaving anyway), so that loading ``size``
        bytes for ``label`` keeps the working set at or under high; ResourceExhausted where
        no choice does. Counts the loads in flight (``ledger.reserved``) as charged already."""
        reading = self.source()
        if reading is None:
            return []
        self._note(reading)
        ceiling = int(self.high * reading.limit_bytes)
        expected = reading.working_set_bytes + ledger.reserved + size - sum(r.size for r in freed)
        if expected <= ceiling:
            return []
        going = {r.digest for r in freed}
        candidates = [
            r
            for r in ranked(ledger.residents.values(), ledger.policy, evictable)
            if r.digest not in going
        ]
        victims = enough(candidates, expected - ceiling)
        if victims is not None:
            return victims
        held = [r for r in ledger.residents.values() if not evictable(r)]
        raise ResourceExhausted(
            f"cannot load {label} ({format_size(size)}) into the {ledger.tier} tier: with it "
            f"this node's memory would reach {format_size(expected)} of its "
            f"{format_size(reading.limit_bytes)} limit, past the high watermark "
            f"({self.high:.0%}: {format_size(ceiling)}), and demoting every other unleased "
            f"copy ({format_size(sum(r.size for r in candidates))}) would not make room; "
            f"{len(held)} copies ({format_size(sum(r.size for r in held))}) are leased or "
            f"pinned and stay. Retry once leases end or memory frees (fewer idle instances), "
            f"acquire from the disk tier, or raise the memory limit",
            tier=ledger.tier,
            reason="memory",
            needed=size,
            used=reading.working_set_bytes,
            limit=reading.limit_bytes,
            watermark=self.high,
            held=sum(r.size for r in held),
        )

    def _note(self, reading: MemoryReading) -> None:
        if reading.share >= self.high:
            self.pressed = True
        elif reading.share < self.low:
            self.pressed = False
