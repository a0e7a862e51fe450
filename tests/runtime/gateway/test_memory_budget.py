"""Instances capped by memory (Note [memory admission] in runtime/gateway/budget.py): idle
instances make room coldest first, a request nothing can make room for gets 503 with
Retry-After, and a gateway without a memory limit behaves as before.

A real gateway with real workers; the memory reading is a :class:`SimulatedMemory` in which
every instance costs a fixed amount, so the cap is reached at a known instance count whatever
the workers really use (what they use is measured, and is far below that cost). The reading
from a real cgroup is tested apart, on a process in a cgroup with a limit.

A start the model store refuses for room (Note [starts refused for capacity] in
runtime/gateway/budget.py) is tested with a real daemon whose cpu tier holds one of two models,
not both: the function of the second needs it in memory (``funcs/inmemory.py``: its init
refuses a copy the store served from disk, as the store refuses an acquire it cannot fit), so
its start is refused while an instance of the first holds its lease.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.cgroup import memory_cgroups
from tests.fixtures.gateway import RunningGateway, echo_spec, pid_alive
from tests.fixtures.store import DaemonProcess
from trims.cgroup import mem_total, memory_cgroup
from trims.errors import ValidationError
from trims.runtime import gateway_cli
from trims.runtime.gateway.budget import InstanceBudget, node_budget
from trims.runtime.gateway.memory import MemoryReading, cgroup_memory, private_bytes
from trims.runtime.settings import GatewaySettings

GIB = 1 << 30


class SimulatedMemory:
    """A memory reading in which each instance the budget counts (draining ones until they
    exit) costs 1 GiB, under a limit whose watermark (0.9) leaves room for ``fits``
    instances: a new one is admitted while ``total`` GiB plus the measured cost of the ones
    starting (far below 0.5 GiB) stays under ``fits - 0.5`` GiB."""

    def __init__(self, budget: InstanceBudget, fits: int) -> None:
        self.budget = budget
        self.limit = int((fits - 0.5) * GIB / 0.9)

    def __call__(self) -> MemoryReading:
        return MemoryReading(usage_bytes=self.budget.total() * GIB, limit_bytes=self.limit)


def simulate(gw: RunningGateway, fits: int) -> None:
    budget = gw.gateway.budget
    budget.memory = SimulatedMemory(budget, fits)


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def scrape(gw: RunningGateway) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with gw.session.get(f"{gw.url}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def stops(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], fn: str, why: str
) -> float:
    key = ("trims_instance_stops_total", (("function", fn), ("reason", why)))
    return samples.get(key, 0.0)


async def pid_of(gw: RunningGateway, name: str) -> int:
    status, _, body = await gw.invoke(name, b"pid")
    assert status == 200, body
    return int(body)


async def test_with_room_instances_start_as_before_and_idle_ones_time_out(start_gateway):
    gw = await start_gateway()
    simulate(gw, fits=4)
    await gw.deploy(echo_spec("one"))
    await gw.deploy(echo_spec("two", idle_timeout_s=0.2))
    pids = [await pid_of(gw, "one"), await pid_of(gw, "two")]
    assert pid_alive(pids[0]), "with room, nothing is stopped for another instance"
    samples = await scrape(gw)
    assert samples[("trims_memory_pressure", ())] == 0.0
    assert samples[("trims_memory_usage_ratio", ())] > 0
    assert stops(samples, "one", "memory_pressure") == 0
    # the instances' own memory was measured: the estimate is no longer the default
    assert gw.gateway.pool("one").instance_memory() is not None

    await until(lambda: not pid_alive(pids[1]), "two's idle timeout")
    await until(lambda: gw.gateway.budget.total() == 1, "two's instance to be gone")
    assert stops(await scrape(gw), "two", "idle_timeout") == 1
    assert pid_alive(pids[0])


async def test_at_the_watermark_the_coldest_idle_instance_of_another_function_makes_room(
    start_gateway,
):
    gw = await start_gateway()
    simulate(gw, fits=2)
    for name in ("one", "two", "three"):
        await gw.deploy(echo_spec(name))
    one, two = await pid_of(gw, "one"), await pid_of(gw, "two")
    three = await pid_of(gw, "three")
    assert not pid_alive(one), "the coldest idle instance is stopped for memory"
    assert pid_alive(two) and pid_alive(three)
    assert gw.gateway.budget.total() <= 2
    samples = await scrape(gw)
    assert stops(samples, "one", "memory_pressure") == 1
    assert stops(samples, "two", "memory_pressure") == 0
    assert samples[("trims_memory_pressure", ())] == 1.0


async def test_with_nothing_idle_a_request_gets_503_with_retry_after_and_others_are_served(
    start_gateway,
):
    gw = await start_gateway()
    simulate(gw, fits=2)
    await gw.deploy(echo_spec("one"))
    await gw.deploy(echo_spec("two", concurrency=2))
    await gw.deploy(echo_spec("three"))
    await pid_of(gw, "one")
    await pid_of(gw, "two")
    busy = [asyncio.create_task(gw.invoke(n, b"sleep:1.5")) for n in ("one", "two")]
    pools = [gw.gateway.pool(n) for n in ("one", "two")]
    await until(lambda: all(s.inflight for p in pools for s in p.slots), "both instances busy")

    status, headers, body = await gw.invoke("three", b"hello")
    assert status == 503, body
    assert int(headers["Retry-After"]) >= 1
    assert b"high watermark" in body
    assert gw.gateway.pool("three").slots == [], "no instance started that would not fit"
    # the gateway keeps serving: "two" has a free slot on its running instance
    assert (await gw.invoke("two", b"still here"))[::2] == (200, b"still here")
    assert [(await t)[0] for t in busy] == [200, 200]
    samples = await scrape(gw)
    refused = ("trims_admissions_refused_total", (("function", "three"), ("reason", "memory")))
    assert samples[refused] == 1
    assert ("trims_invocations_total", (("function", "three"), ("status", "503"))) in samples

    # once an instance is idle it makes room, and the refused function starts
    assert (await gw.invoke("three", b"again"))[::2] == (200, b"again")
    assert gw.gateway.budget.total() <= 2


async def test_concurrent_first_requests_start_one_instance_and_the_memory_cap_holds(
    start_gateway,
):
    gw = await start_gateway()
    simulate(gw, fits=2)
    await gw.deploy(echo_spec("single", max_instances=1))
    await gw.deploy(echo_spec("wide", max_instances=4, queue_size=16))
    results = await asyncio.gather(*(gw.invoke("single", b"pid") for _ in range(8)))
    assert {r[0] for r in results} == {200}
    assert len({r[2] for r in results}) == 1, "one instance start served every request"

    # 8 requests at once to a function that may run 4 instances: memory for one more (the
    # single's is idle, and is stopped for a second), all 8 answered by those two
    results = await asyncio.gather(*(gw.invoke("wide", b"sleep:0.3") for _ in range(8)))
    assert {r[0] for r in results} == {200}
    samples = await scrape(gw)
    assert samples[("trims_cold_starts_total", (("function", "single"),))] == 1
    assert samples[("trims_cold_starts_total", (("function", "wide"),))] == 2
    assert stops(samples, "single", "memory_pressure") == 1


async def test_without_a_memory_limit_nothing_is_capped_by_memory(start_gateway):
    def unlimited() -> MemoryReading | None:
        return None

    def limited() -> MemoryReading | None:
        return MemoryReading(usage_bytes=GIB, limit_bytes=2 * GIB)

    assert node_budget(GatewaySettings(), unlimited).memory is None
    assert node_budget(GatewaySettings(memory_high_watermark=None), limited).memory is None
    budget = node_budget(GatewaySettings(memory_high_watermark=0.5), limited)
    assert (budget.memory, budget.watermark) == (limited, 0.5)

    gw = await start_gateway()
    if memory_cgroup().limit_bytes == mem_total():
        assert gw.gateway.budget.memory is None
    gw.gateway.budget.memory = None
    for name in ("one", "two", "three"):
        await gw.deploy(echo_spec(name))
    pids = [await pid_of(gw, n) for n in ("one", "two", "three")]
    assert all(pid_alive(p) for p in pids)
    samples = await scrape(gw)
    assert not any(name.startswith("trims_memory_") for name, _ in samples)


def one_of_two_models(start_daemon: Callable[..., DaemonProcess]) -> DaemonProcess:
    """A daemon whose cpu tier (1 MiB) holds one of its models a and b (600 KB each)."""
    return start_daemon(
        cpu_budget="1MiB",
        models={m: {"w": np.full(150_000, i, np.float32)} for i, m in enumerate("ab")},
    )


def with_model(spec: dict[str, Any], model: str) -> dict[str, Any]:
    return {**spec, "models": [{"name": model}]}


async def store_gateway(start_gateway: Any, daemon: DaemonProcess) -> RunningGateway:
    """A gateway on ``daemon`` with functions one (model a) and two (model b, in memory)."""
    gw = await start_gateway(store_socket=daemon.socket)
    gw.gateway.budget.memory = None  # the store's room is tested, not the gateway's memory
    await gw.deploy(with_model(echo_spec("one", concurrency=2), "a"))
    await gw.deploy(with_model(echo_spec("two", "inmemory:handler"), "b"))
    return gw


def failures(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], fn: str) -> float:
    return samples[("trims_instance_failures_total", (("function", fn),))]


async def test_a_start_the_store_has_no_room_for_stops_an_idle_instance_and_is_retried(
    start_gateway, start_daemon
):
    gw = await store_gateway(start_gateway, one_of_two_models(start_daemon))
    one = await pid_of(gw, "one")

    status, _, body = await gw.invoke("two", b"hello")
    assert (status, body) == (200, b"hello"), "the start is retried once one's instance stopped"
    assert not pid_alive(one), "one's idle instance was stopped: its lease kept b out"
    samples = await scrape(gw)
    assert stops(samples, "one", "store_capacity") == 1
    assert failures(samples, "two") == 0, "a full store is not the function's failure"
    assert gw.gateway.pool("two").start_error is None
    assert (await gw.invoke("one", b"back"))[::2] == (200, b"back")


async def test_a_start_the_store_has_no_room_for_with_nothing_idle_gets_503_with_retry_after(
    start_gateway, start_daemon
):
    gw = await store_gateway(start_gateway, one_of_two_models(start_daemon))
    await pid_of(gw, "one")
    busy = asyncio.create_task(gw.invoke("one", b"sleep:5"))
    pool = gw.gateway.pool("one")
    await until(lambda: any(s.inflight for s in pool.slots), "one's instance busy")

    status, headers, body = await gw.invoke("two", b"hello")
    assert status == 503, body
    assert int(headers["Retry-After"]) >= 1
    assert b"model store has no room" in body
    # the gateway keeps serving, and two is not marked failed (its model stays ready)
    assert (await gw.invoke("one", b"still here"))[::2] == (200, b"still here")
    assert gw.gateway.pool("two").start_error is None
    samples = await scrape(gw)
    assert samples[("trims_admissions_refused_total", (("function", "two"), ("reason", "store")))]
    assert failures(samples, "two") == 0
    assert ("trims_invocations_total", (("function", "two"), ("status", "503"))) in samples

    assert (await busy)[0] == 200
    assert (await gw.invoke("two", b"again"))[::2] == (200, b"again"), "one's idle makes room"


def test_the_reading_comes_from_the_process_cgroup_less_inactive_file_pages():
    with memory_cgroups(2 if memory_cgroup().version == 2 else 1) as cgroups:
        cgroup = cgroups.make(limit=256 << 20)
        script = "import sys; b = bytearray(48 << 20); b[::4096] = b'x' * len(b[::4096]); "
        script += "print('ready', flush=True); sys.stdin.read()"
        child = subprocess.Popen(
            cgroups.command(cgroup, [sys.executable, "-c", script]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
            reading = cgroup_memory(child.pid)
            assert reading is not None
            assert reading.limit_bytes == 256 << 20
            assert 48 << 20 <= reading.usage_bytes < 256 << 20
            own = private_bytes(child.pid)
            assert own is not None and own >= 48 << 20
        finally:
            assert child.stdin is not None
            child.stdin.close()
            child.wait(10)
    assert private_bytes(child.pid) is None, "an ended process has no memory"


def test_the_watermark_flag_takes_a_share_of_the_limit_or_off():
    def settings(*argv: str) -> GatewaySettings:
        parser = argparse.ArgumentParser()
        gateway_cli.configure(parser)
        return gateway_cli.settings_from_args(parser.parse_args(list(argv)), {})

    assert settings().memory_high_watermark == 0.9
    assert settings("--memory-high-watermark", "0.75").memory_high_watermark == 0.75
    assert settings("--memory-high-watermark", "off").memory_high_watermark is None
    for bad in ("0", "1.5"):
        with pytest.raises(ValidationError, match="memory high watermark"):
            settings("--memory-high-watermark", bad)
