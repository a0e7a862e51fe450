"""The pool's state machine (runtime/gateway/pool.py) on the in-process executor, in milliseconds.

Instances run Python callables in the test's event loop (runtime/executors/inprocess.py), so
every transition is reached by awaiting the event that causes it: a handler's request arriving
(:class:`Held`), an instance starting, becoming ready or being stopped
(``InProcessExecutor.until``). Where a test needs one request queued before another arrives,
it relies on asyncio running tasks' first steps in the order they were created: each request
task runs up to its first suspension (taking a slot, queueing, or being refused) before the
next one starts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from trims.errors import QueueFull, Timeout, Unavailable, UpstreamError
from trims.runtime.executors.base import Instance
from trims.runtime.executors.inprocess import (
    InProcessExecutor,
    InProcessFunction,
    InProcessInstance,
)
from trims.runtime.functions.spec import parse_spec
from trims.runtime.gateway.budget import InstanceBudget
from trims.runtime.gateway.metrics import GatewayMetrics
from trims.runtime.gateway.pool import Pool


class Held:
    """A handler whose requests wait until the test answers them, in arrival order."""

    def __init__(self) -> None:
        self.executor: InProcessExecutor | None = None
        self.waiting: list[asyncio.Future[bytes]] = []

    async def __call__(self, body: bytes, headers: Any) -> bytes:
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        assert self.executor is not None
        self.executor.changed()
        return await fut

    async def arrived(self, n: int) -> None:
        """Return once ``n`` requests have reached the handler."""
        assert self.executor is not None
        await self.executor.until(lambda: len(self.waiting) >= n, f"{n} requests at the handler")

    def answer(self, i: int, body: bytes = b"ok") -> None:
        self.waiting[i].set_result(body)


async def tasks_start() -> None:
    """Let the tasks created so far run to their first suspension (queued, or refused).

    A new task's first step is already scheduled; yielding once puts this task behind it. No
    time passes: this orders events, it does not wait for them.
    """
    await asyncio.sleep(0)


async def echo(body: bytes, headers: Any) -> bytes:
    return body


async def call(instance: Instance, timeout: float) -> tuple[str, bytes]:
    """What the gateway's invoke route does with a slot: one request, with its instance id."""
    reply = await instance.invoke(b"ping", {}, timeout=timeout, trace={})
    return instance.id, reply.body


@pytest.fixture
async def make_pool() -> AsyncIterator[Callable[..., tuple[Pool, InProcessExecutor]]]:
    """Factory: ``make_pool(function, **scaling)`` -> a started pool of ``fn`` and its executor
    (``budget=``, ``name=`` and ``executor=`` as keywords); closed at teardown."""
    made: list[tuple[Pool, InProcessExecutor]] = []

    def make(
        function: InProcessFunction,
        *,
        name: str = "fn",
        budget: InstanceBudget | None = None,
        executor: InProcessExecutor | None = None,
        **scaling: Any,
    ) -> tuple[Pool, InProcessExecutor]:
        if executor is None:
            executor = InProcessExecutor({name: function})
        else:
            executor.functions[name] = function
        if isinstance(function.invoke, Held):
            function.invoke.executor = executor
        spec = parse_spec({"name": name, "handler": "inprocess:handler", "scaling": scaling})
        pool = Pool(
            spec,
            executor,
            GatewayMetrics(lambda: {}),
            budget=budget,
            start_timeout_s=5.0,
            stop_grace_s=0.01,
            standby_refill_s=0.0,
        )
        pool.start()
        made.append((pool, executor))
        return pool, executor

    yield make
    for pool, executor in made:
        await pool.close(0.0)
        await executor.close()
        assert not executor.live(), "the pool left instances running after close"


async def test_scales_from_zero_on_the_first_request(make_pool: Any) -> None:
    pool, executor = make_pool(InProcessFunction(invoke=echo))
    assert executor.started == [] and pool.slots == []
    instance_id, body = await pool.run(call)
    assert body == b"ping"
    assert [i.id for i in executor.started] == [instance_id]
    assert pool.counts() == {"standby": 0, "starting": 0, "ready": 1, "draining": 0}


async def test_requests_during_a_cold_start_wait_for_that_instance(make_pool: Any) -> None:
    gate = asyncio.Event()

    async def init(instance: InProcessInstance) -> None:
        await gate.wait()

    pool, executor = make_pool(
        InProcessFunction(invoke=echo, init=init), concurrency=2, max_instances=4
    )
    requests = [asyncio.create_task(pool.run(call)) for _ in range(2)]
    await executor.until(lambda: len(executor.started) == 1, "the cold start")
    assert pool.pending == 2
    gate.set()
    served_by = {instance_id for instance_id, _ in await asyncio.gather(*requests)}
    assert served_by == {executor.started[0].id}
    assert len(executor.started) == 1, "two queued requests fit one instance of concurrency 2"


async def test_concurrency_slots_bound_each_instance(make_pool: Any) -> None:
    held = Held()
    pool, executor = make_pool(InProcessFunction(invoke=held), concurrency=2, max_instances=1)
    requests = [asyncio.create_task(pool.run(call)) for _ in range(3)]
    await held.arrived(2)
    (instance,) = executor.started
    assert instance.inflight == 2
    assert pool.pending == 1
    held.answer(0)
    await held.arrived(3)
    assert pool.pending == 0
    held.answer(1)
    held.answer(2)
    assert [body for _, body in await asyncio.gather(*requests)] == [b"ok"] * 3


async def test_queued_demand_scales_out_to_max_instances(make_pool: Any) -> None:
    held = Held()
    pool, executor = make_pool(InProcessFunction(invoke=held), concurrency=1, max_instances=3)
    requests = [asyncio.create_task(pool.run(call)) for _ in range(4)]
    await held.arrived(3)
    assert len(executor.started) == 3
    assert pool.pending == 1
    for i in range(3):
        held.answer(i)
    await held.arrived(4)
    held.answer(3)
    served_by = {instance_id for instance_id, _ in await asyncio.gather(*requests)}
    assert served_by == {i.id for i in executor.started}
    assert len(executor.started) == 3


async def test_a_full_queue_answers_429_with_retry_after(make_pool: Any) -> None:
    held = Held()
    pool, _ = make_pool(InProcessFunction(invoke=held), max_instances=1, queue_size=1)
    first = asyncio.create_task(pool.run(call))
    await held.arrived(1)
    queued = asyncio.create_task(pool.run(call))
    refused = asyncio.create_task(pool.run(call))
    with pytest.raises(QueueFull, match=r"1 requests queued \(queue_size 1\)") as e:
        await refused
    assert e.value.http_status == 429
    assert 1 <= e.value.details["retry_after_s"] <= 60
    held.answer(0)
    await held.arrived(2)
    held.answer(1)
    assert (await first)[1] == (await queued)[1] == b"ok"


async def test_a_request_past_its_timeout_gets_504_and_its_instance_is_recycled(
    make_pool: Any,
) -> None:
    held = Held()
    pool, executor = make_pool(InProcessFunction(invoke=held), request_timeout_s=0.05)
    with pytest.raises(Timeout, match="did not answer within") as e:
        await pool.run(call)
    assert e.value.http_status == 504
    (hung,) = executor.started
    await executor.until(lambda: hung.id in executor.stopped, "the hung instance stopped")
    assert hung.exit_reason is not None and not hung.alive()
    assert pool.slots == []


async def test_a_queued_request_times_out_when_no_instance_frees(make_pool: Any) -> None:
    async def init(instance: InProcessInstance) -> None:
        await asyncio.Event().wait()

    pool, _ = make_pool(InProcessFunction(invoke=echo, init=init), request_timeout_s=0.05)
    with pytest.raises(Timeout, match="found no free instance within its request timeout"):
        await pool.run(call)
    assert pool.pending == 0
    assert pool.counts()["starting"] == 1, "the start goes on for the next request"


async def test_a_crash_fails_inflight_requests_with_502_and_a_replacement_serves_the_queue(
    make_pool: Any,
) -> None:
    held = Held()
    pool, executor = make_pool(InProcessFunction(invoke=held), max_instances=1)
    inflight = asyncio.create_task(pool.run(call))
    await held.arrived(1)
    queued = asyncio.create_task(pool.run(call))
    await tasks_start()
    assert pool.pending == 1
    first = executor.started[0]
    first.crash("killed by SIGKILL")
    with pytest.raises(UpstreamError, match=f"instance {first.id} of fn died: killed by SIGKILL"):
        await inflight
    await held.arrived(2)
    held.answer(1, b"from the replacement")
    instance_id, body = await queued
    assert body == b"from the replacement"
    assert instance_id == executor.started[1].id != first.id
    assert first.id in executor.stopped


async def test_a_dead_idle_instance_is_replaced_when_a_request_finds_it(make_pool: Any) -> None:
    pool, executor = make_pool(InProcessFunction(invoke=echo))
    first_id, _ = await pool.run(call)
    executor.started[0].crash("out of memory")
    second_id, body = await pool.run(call)
    assert body == b"ping" and second_id != first_id
    assert [i.id for i in executor.started] == [first_id, second_id]


async def test_min_instances_start_warm_and_are_replaced_when_they_die(make_pool: Any) -> None:
    pool, executor = make_pool(InProcessFunction(invoke=echo), min_instances=2, idle_timeout_s=0.2)
    await executor.until(lambda: sum(i.ready for i in executor.live()) == 2, "two warm instances")
    assert pool.counts()["ready"] == 2
    dead = executor.started[0]
    dead.crash("killed by SIGSEGV")
    await executor.until(
        lambda: len(executor.started) == 3 and executor.started[2].ready,
        "the reaper's replacement of the dead warm instance",
    )
    await executor.until(lambda: dead.id in executor.stopped, "the dead instance cleaned up")
    assert pool.counts() == {"standby": 0, "starting": 0, "ready": 2, "draining": 0}


async def test_idle_instances_scale_down_to_min_instances(make_pool: Any) -> None:
    held = Held()
    pool, executor = make_pool(
        InProcessFunction(invoke=held), min_instances=1, max_instances=2, idle_timeout_s=0.01
    )
    requests = [asyncio.create_task(pool.run(call)) for _ in range(2)]
    await held.arrived(2)
    held.answer(0)
    held.answer(1)
    await asyncio.gather(*requests)
    await executor.until(lambda: len(executor.stopped) == 1, "one idle instance stopped")
    assert pool.counts() == {"standby": 0, "starting": 0, "ready": 1, "draining": 0}
    assert len(executor.live()) == 1


async def test_idle_instances_scale_to_zero(make_pool: Any) -> None:
    pool, executor = make_pool(InProcessFunction(invoke=echo), idle_timeout_s=0.01)
    instance_id, _ = await pool.run(call)
    await executor.until(lambda: instance_id in executor.stopped, "scale to zero")
    assert pool.slots == [] and executor.live() == []


async def test_close_drains_queued_and_inflight_requests_and_refuses_new_ones(
    make_pool: Any,
) -> None:
    held = Held()
    pool, executor = make_pool(InProcessFunction(invoke=held), max_instances=1)
    inflight = asyncio.create_task(pool.run(call))
    await held.arrived(1)
    queued = asyncio.create_task(pool.run(call))
    closing = asyncio.create_task(pool.close(5.0))
    late = asyncio.create_task(pool.run(call))
    with pytest.raises(Unavailable, match="shutting down") as e:
        await late
    assert e.value.http_status == 503
    assert not closing.done()
    held.answer(0)
    await held.arrived(2)
    held.answer(1)
    assert (await inflight)[1] == (await queued)[1] == b"ok"
    await closing
    assert pool.slots == [] and executor.live() == []
    assert [i.id for i in executor.started] == executor.stopped


async def test_close_past_its_drain_timeout_kills_what_still_runs(make_pool: Any) -> None:
    held = Held()
    pool, executor = make_pool(InProcessFunction(invoke=held))
    inflight = asyncio.create_task(pool.run(call))
    await held.arrived(1)
    await pool.close(0.0)
    with pytest.raises(UpstreamError, match=r"died: killed by SIGKILL after a 0\.01 s drain"):
        await inflight
    assert executor.live() == []


async def test_the_instance_budget_evicts_another_functions_idle_instance(
    make_pool: Any,
) -> None:
    budget = InstanceBudget(1)
    executor = InProcessExecutor({})
    a, _ = make_pool(InProcessFunction(invoke=echo), name="a", budget=budget, executor=executor)
    b, _ = make_pool(InProcessFunction(invoke=echo), name="b", budget=budget, executor=executor)
    a_id, _ = await a.run(call)
    b_id, body = await b.run(call)
    assert body == b"ping"
    assert a_id in executor.stopped, "a's idle instance made room for b's"
    assert [i.id for i in executor.live()] == [b_id]
    assert a.slots == [] and budget.total() == 1


async def test_the_budget_holds_a_request_until_an_instance_frees(make_pool: Any) -> None:
    budget = InstanceBudget(1)
    executor = InProcessExecutor({})
    held = Held()
    a, _ = make_pool(InProcessFunction(invoke=held), name="a", budget=budget, executor=executor)
    b, _ = make_pool(InProcessFunction(invoke=echo), name="b", budget=budget, executor=executor)
    busy = asyncio.create_task(a.run(call))
    await held.arrived(1)
    waiting = asyncio.create_task(b.run(call))
    await tasks_start()
    assert b.pending == 1
    assert len(executor.started) == 1, "a busy instance is never evicted"
    held.answer(0)
    await busy
    _, body = await waiting
    assert body == b"ping"
    assert len(executor.live()) == 1


async def test_a_failed_start_answers_502_with_the_reason_and_sets_start_error(
    make_pool: Any,
) -> None:
    async def init(instance: InProcessInstance) -> None:
        raise RuntimeError("model weights missing")

    pool, executor = make_pool(InProcessFunction(invoke=echo, init=init))
    with pytest.raises(UpstreamError, match="RuntimeError: model weights missing") as e:
        await pool.run(call)
    assert e.value.http_status == 502
    assert pool.start_error is not None and "model weights missing" in pool.start_error
    await executor.until(lambda: executor.live() == [], "the failed instance cleaned up")


async def test_a_handler_error_is_502_and_keeps_the_instance(make_pool: Any) -> None:
    calls = 0

    async def flaky(body: bytes, headers: Any) -> bytes:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ValueError("bad input")
        return b"fine"

    pool, executor = make_pool(InProcessFunction(invoke=flaky))
    with pytest.raises(UpstreamError, match="handler of fn raised ValueError: bad input"):
        await pool.run(call)
    assert (await pool.run(call))[1] == b"fine"
    assert len(executor.started) == 1 and executor.stopped == []


# -- standby instances (Note [standby instances] in runtime/gateway/pool.py) ---------------


class Counted:
    """``init`` and ``prepare`` that count their calls per instance (``prepare`` may fail)."""

    def __init__(self, fail_prepare: int = 0) -> None:
        self.inits: list[str] = []
        self.prepares: list[str] = []
        self.fail_prepare = fail_prepare

    async def init(self, instance: InProcessInstance) -> None:
        self.inits.append(instance.id)

    async def prepare(self, instance: InProcessInstance) -> None:
        self.prepares.append(instance.id)
        if len(self.prepares) <= self.fail_prepare:
            raise RuntimeError("the model is not in the store")

    def function(self) -> InProcessFunction:
        return InProcessFunction(invoke=echo, init=self.init, prepare=self.prepare)


def _prepared(executor: InProcessExecutor, n: int) -> bool:
    return sum(1 for i in executor.live() if i.prepared and not i.ready) == n


async def test_a_standby_is_prepared_at_deploy_and_the_first_request_activates_it(
    make_pool: Any,
) -> None:
    counted = Counted()
    pool, executor = make_pool(counted.function(), standby=1)
    await executor.until(lambda: _prepared(executor, 1), "the standby prepared")
    standby = executor.started[0]
    assert counted.inits == [], "a standby runs no init"
    assert pool.counts() == {"standby": 1, "starting": 0, "ready": 0, "draining": 0}

    instance_id, body = await pool.run(call)
    assert (instance_id, body) == (standby.id, b"ping"), "the request went to the standby"
    assert counted.inits == [standby.id]
    # Replaced once the activated instance is ready: the next scale-from-zero is warm too.
    await executor.until(lambda: _prepared(executor, 1), "the replacement standby prepared")
    assert pool.counts() == {"standby": 1, "starting": 0, "ready": 1, "draining": 0}
    assert counted.inits == [standby.id]
    assert len(executor.started) == 2


async def test_a_standby_serves_no_request_and_counts_in_no_instance_limit(make_pool: Any) -> None:
    counted = Counted()
    pool, executor = make_pool(counted.function(), standby=1, min_instances=1, max_instances=1)
    await executor.until(
        lambda: _prepared(executor, 1) and pool.counts()["ready"] == 1, "warm + standby"
    )
    for _ in range(3):
        instance_id, _ = await pool.run(call)
        assert executor.started[0].ready and instance_id == executor.started[0].id
    assert pool.counts() == {"standby": 1, "starting": 0, "ready": 1, "draining": 0}


async def test_a_dead_standby_is_replaced(make_pool: Any) -> None:
    counted = Counted()
    pool, executor = make_pool(counted.function(), standby=1, idle_timeout_s=0.2)
    await executor.until(lambda: _prepared(executor, 1), "the standby prepared")
    dead = executor.started[0]
    dead.crash("killed by SIGKILL")
    await executor.until(
        lambda: dead.id in executor.stopped and _prepared(executor, 1), "the replacement"
    )
    instance_id, _ = await pool.run(call)
    assert instance_id == executor.started[1].id != dead.id


async def test_failed_preparations_stop_the_refills_until_an_instance_starts(
    make_pool: Any,
) -> None:
    counted = Counted(fail_prepare=10)
    pool, executor = make_pool(counted.function(), standby=1, idle_timeout_s=0.2)
    await executor.until(lambda: len(counted.prepares) == 3, "three failed preparations")
    await executor.until(lambda: len(executor.stopped) == 3, "the failed standbys stopped")
    assert pool.counts()["standby"] == 0
    # What the reaper does on each tick starts no fourth preparation.
    before = len(executor.started)
    pool._fill_standby()
    await asyncio.sleep(0)  # a started preparation would have run its first step
    assert len(executor.started) == before and pool.counts()["standby"] == 0
    # A request starts an instance the ordinary way; its success lets refills resume.
    counted.fail_prepare = 0
    instance_id, body = await pool.run(call)
    assert body == b"ping" and instance_id not in counted.prepares
    await executor.until(lambda: _prepared(executor, 1), "refills resumed")


async def test_the_budget_drops_a_standby_before_evicting_an_idle_instance(
    make_pool: Any,
) -> None:
    budget = InstanceBudget(2)
    executor = InProcessExecutor({})
    a, _ = make_pool(Counted().function(), name="a", budget=budget, executor=executor, standby=1)
    b, _ = make_pool(InProcessFunction(invoke=echo), name="b", budget=budget, executor=executor)
    await executor.until(lambda: _prepared(executor, 1), "a's standby prepared")
    b_first, _ = await b.run(call)
    assert budget.total() == 2
    c_pool, _ = make_pool(InProcessFunction(invoke=echo), name="c", budget=budget,
                          executor=executor)  # fmt: skip
    _, body = await c_pool.run(call)
    assert body == b"ping"
    standby = executor.started[0]
    assert standby.id in executor.stopped, "a's standby made room"
    assert b_first not in executor.stopped, "b's idle instance kept"
    # No room now: a keeps no standby until some is made.
    assert a.counts()["standby"] == 0 and budget.total() == 2


async def test_a_standby_whose_init_fails_answers_the_request_with_the_reason(
    make_pool: Any,
) -> None:
    async def broken_init(instance: InProcessInstance) -> None:
        raise RuntimeError("CUDA out of memory")

    pool, executor = make_pool(InProcessFunction(invoke=echo, init=broken_init), standby=1)
    await executor.until(lambda: _prepared(executor, 1), "the standby prepared")
    with pytest.raises(UpstreamError, match="CUDA out of memory"):
        await pool.run(call)
    assert pool.start_error is not None and "CUDA out of memory" in pool.start_error


async def test_a_standby_dropped_while_it_prepares_is_stopped_and_not_a_failure(
    make_pool: Any,
) -> None:
    budget = InstanceBudget(1)
    executor = InProcessExecutor({})
    release = asyncio.Event()

    async def slow_prepare(instance: InProcessInstance) -> None:
        await release.wait()

    slow = InProcessFunction(invoke=echo, prepare=slow_prepare)
    a, _ = make_pool(slow, name="a", budget=budget, executor=executor, standby=1)
    await executor.until(lambda: executor.started and executor.started[0].inflight == 1,
                         "a's standby preparing")  # fmt: skip
    b, _ = make_pool(InProcessFunction(invoke=echo), name="b", budget=budget, executor=executor)
    _, body = await b.run(call)
    assert body == b"ping"
    standby = executor.started[0]
    await executor.until(lambda: standby.id in executor.stopped, "the preparing standby stopped")
    assert a.slots == [] and a._standby_failures == 0
    assert [i.id for i in executor.live()] == [executor.started[1].id]


@pytest.mark.parametrize(("request_timeout_s", "retry_after"), [(30.0, (4, 5)), (2.0, (2, 2))])
async def test_retry_after_is_the_time_the_full_queue_needs(
    make_pool: Any, request_timeout_s: float, retry_after: tuple[int, int]
) -> None:
    """16 requests queued for one instance that takes 0.25 s a request need 4 s: the 429 says
    so (it said 1 s), and never more than the request timeout, by when each has been answered
    or timed out."""
    held = Held()

    async def handler(body: bytes, headers: Any) -> bytes:
        if body == b"work":
            await asyncio.sleep(0.25)  # the work a request takes: this is measured, not waited on
            return body
        return await held(body, headers)

    async def work(instance: Instance, timeout: float) -> bytes:
        return (await instance.invoke(b"work", {}, timeout=timeout, trace={})).body

    pool, held.executor = make_pool(
        InProcessFunction(invoke=handler),
        max_instances=1,
        queue_size=16,
        request_timeout_s=request_timeout_s,
    )
    for _ in range(2):
        assert await pool.run(work) == b"work"
    first = asyncio.create_task(pool.run(call))
    await held.arrived(1)
    queued = [asyncio.create_task(pool.run(call)) for _ in range(16)]
    await tasks_start()
    with pytest.raises(QueueFull) as e:
        await pool.run(call)
    assert retry_after[0] <= e.value.details["retry_after_s"] <= retry_after[1]
    for i in range(17):
        await held.arrived(i + 1)
        held.answer(i)
    assert all(reply == b"ok" for _, reply in await asyncio.gather(first, *queued))
