"""Memory pressure (Note [memory pressure] in trims.daemon.pressure), the policy in process.

A real Store on real tiers and files, whose cgroup reading is injected: the working set is the
CPU tier's copies plus what the test says the cgroup's other processes hold, so each check
and each load sees exactly the memory the test sets. A real daemon in a real memory cgroup is
tested in test_memory_limit.py.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures.store import seed_layout
from trims.daemon.cli import build_settings, configure
from trims.daemon.metrics import DaemonMetrics
from trims.daemon.pressure import MemoryReading
from trims.daemon.settings import DaemonSettings, TierBudgets
from trims.daemon.store import Caller, Store
from trims.errors import ResourceExhausted, ValidationError
from trims.protocol import PeerCredentials

#: Bytes of each test model (one tensor of 64 KiB: the layout adds nothing).
SIZE = 64 << 10
#: The limit: ten models. High watermark 9, low 8.
LIMIT = 10 * SIZE
CALLER = Caller(1, PeerCredentials(os.getpid(), 0, 0), admin=True, pid=os.getpid())


@dataclass
class Node:
    """A store whose memory reading is its CPU tier plus ``others`` bytes."""

    store: Store
    metrics: DaemonMetrics
    others: int = 0

    def reading(self) -> MemoryReading:
        return MemoryReading(self.others + self.store.res.ledgers["cpu"].used, LIMIT)

    async def acquire(self, name: str, *, strict: bool = False) -> str:
        reply = await self.store.acquire(CALLER, name, None, None, "cpu", None, strict=strict)
        for fd in reply.fds if reply.close_fds else ():
            os.close(fd)
        return str(reply.result["lease"])

    async def touch(self, name: str) -> None:
        """Acquire and release: the copy is resident, unleased and the most recently used."""
        self.store.release(CALLER, await self.acquire(name))

    def in_cpu(self) -> set[str]:
        return {
            r.name
            for r in self.store.catalog.all()
            if "cpu" in self.store.res.resident_tiers(r.digest)
        }

    def metric(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    """Factory: ``node(**settings)`` -> a started Node over five models a..e."""
    made: list[Store] = []

    def make(**options: Any) -> Node:
        store_dir = tmp_path / f"store{len(made)}"
        for i, name in enumerate("abcde"):
            seed_layout(store_dir, name, {"w": np.full(SIZE // 4, i, np.float32)})
        settings = DaemonSettings(
            store_dir=store_dir,
            socket_path=tmp_path / "store.sock",
            cpu_backing="memfd",
            **options,
        )
        holder: list[Node] = []
        metrics = DaemonMetrics()
        store = Store(settings, metrics, memory=lambda: holder[0].reading())
        made.append(store)
        store.start()
        holder.append(Node(store, metrics))
        assert store.catalog.get("a", None).total_bytes == SIZE
        return holder[0]

    yield make
    for store in made:
        store.close()


async def test_unleased_copies_are_demoted_lru_first_until_under_the_low_watermark(
    node: Callable[..., Node],
) -> None:
    n = node()
    lease_b = await n.acquire("b")
    for name in "acde":
        await n.touch(name)
    await n.store.pin(CALLER, "d", None, "cpu")
    n.others = 4 * SIZE  # 9 of 10: at the high watermark
    n.others -= 1
    n.store.res.relieve_pressure()
    assert n.in_cpu() == set("abcde") and n.metric("trims_daemon_memory_pressure") == 0
    n.others += 1
    n.store.res.relieve_pressure()
    # 9 -> under 8: two copies go, least recently used first; b is leased, d pinned
    assert n.in_cpu() == set("bde")
    assert n.store.res.resident_tiers(n.store.catalog.get("a", None).digest) == ["disk"]
    assert n.metric("trims_daemon_demotions_total", tier="cpu", reason="memory_pressure") == 2
    assert n.metric("trims_daemon_memory_pressure") == 0  # 7 of 10 now
    # the demoted copies are still served: the next acquire loads them back
    await n.touch("a")
    assert "a" in n.in_cpu()
    n.store.release(CALLER, lease_b)


async def test_with_only_leased_and_pinned_copies_left_the_pressure_stays_and_loads_are_refused(
    node: Callable[..., Node], caplog: pytest.LogCaptureFixture
) -> None:
    n = node()
    lease_a = await n.acquire("a")
    await n.touch("b")
    await n.store.pin(CALLER, "b", None, "cpu")
    await n.touch("c")
    n.others = 7 * SIZE  # 10 of 10 with a, b and c
    n.store.res.relieve_pressure()
    assert n.in_cpu() == {"a", "b"}  # c demoted; a leased, b pinned
    assert n.metric("trims_daemon_memory_pressure") == 1  # 10 - 1 = 9 of 10: still at high
    for _ in range(3):
        n.store.res.relieve_pressure()
    (stuck,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "no copy in the cpu tier can be demoted (2 leased or pinned, 128.0 KiB)" in stuck
    with pytest.raises(ResourceExhausted) as refused:
        await n.acquire("c", strict=True)
    message = refused.value.message
    assert "cannot load c:1 (64.0 KiB) into the cpu tier" in message
    assert "640.0 KiB limit" in message and "high watermark (90%" in message
    assert "2 copies (128.0 KiB) are leased or pinned" in message
    assert refused.value.details["reason"] == "memory"
    assert n.metric("trims_daemon_loads_refused_total", tier="cpu", reason="memory") == 1
    # not strict: the disk file instead (Note [degraded acquires] in trims.daemon.store)
    degraded = await n.store.acquire(CALLER, "c", None, None, "cpu", None)
    assert (degraded.result["tier"], degraded.result["degraded_from"]) == ("disk", "cpu")
    os.close(degraded.fds[0])
    n.store.release(CALLER, degraded.result["lease"])
    assert n.metric("trims_daemon_acquires_degraded_total", tier="cpu", reason="memory") == 1
    # what is resident is still served; nothing was demoted for the refused load
    n.store.release(CALLER, await n.acquire("a"))
    assert n.in_cpu() == {"a", "b"}
    # memory frees elsewhere: the pressure ends and the load goes through
    n.others = 4 * SIZE
    n.store.res.relieve_pressure()
    assert n.metric("trims_daemon_memory_pressure") == 0
    n.store.release(CALLER, await n.acquire("c"))
    assert n.in_cpu() == {"a", "b", "c"}
    n.store.release(CALLER, lease_a)


async def test_a_load_that_would_pass_the_high_watermark_first_demotes(
    node: Callable[..., Node],
) -> None:
    n = node()
    for name in "abc":
        await n.touch(name)
    n.others = 5 * SIZE + SIZE // 2  # 8.5 of 10; d would make 9.5
    n.store.res.relieve_pressure()
    assert n.in_cpu() == set("abc")
    await n.touch("d")
    assert n.in_cpu() == set("bcd")
    assert n.metric("trims_daemon_demotions_total", tier="cpu", reason="memory_pressure") == 1
    assert n.metric("trims_daemon_loads_refused_total", tier="cpu", reason="memory") == 0


async def test_budget_evictions_and_requests_are_counted_by_reason(
    node: Callable[..., Node],
) -> None:
    n = node(budgets=TierBudgets(cpu=2 * SIZE))
    for name in "abc":
        await n.touch(name)
    await n.store.evict(CALLER, "c", None, "cpu")
    assert n.metric("trims_daemon_demotions_total", tier="cpu", reason="budget") == 1
    assert n.metric("trims_daemon_demotions_total", tier="cpu", reason="request") == 1
    assert n.metric("trims_daemon_demotions_total", tier="cpu", reason="memory_pressure") == 0


async def test_off_or_without_a_limit_nothing_is_demoted(node: Callable[..., Node]) -> None:
    off = node(memory_high_watermark=None)
    await off.touch("a")
    off.others = LIMIT
    off.store.res.relieve_pressure()
    await off.touch("b")
    assert off.in_cpu() == {"a", "b"}
    unknown = node()
    pressure = unknown.store.res.pressure
    assert pressure is not None
    pressure.source = lambda: None
    await unknown.touch("a")
    unknown.store.res.relieve_pressure()
    await unknown.touch("b")
    assert unknown.in_cpu() == {"a", "b"}
    assert unknown.metric("trims_daemon_memory_pressure") == 0


def _watermarks(*argv: str) -> tuple[float | None, float]:
    parser = argparse.ArgumentParser()
    configure(parser)
    settings, _, _ = build_settings(parser.parse_args(list(argv)), {})
    return settings.memory_high_watermark, settings.memory_low_watermark


def test_watermark_flags() -> None:
    assert _watermarks() == (0.9, 0.8)
    assert _watermarks("--memory-high-watermark", "off") == (None, 0.8)
    assert _watermarks("--memory-high-watermark", "0.95", "--memory-low-watermark", "0.7") == (
        0.95,
        0.7,
    )
    with pytest.raises(ValidationError, match="0 < low < high <= 1"):
        _watermarks("--memory-low-watermark", "0.9")
    with pytest.raises(ValidationError, match="0 < low < high <= 1"):
        _watermarks("--memory-high-watermark", "1.5")
    with pytest.raises(ValidationError, match="invalid --memory-high-watermark 'lots'"):
        _watermarks("--memory-high-watermark", "lots")
