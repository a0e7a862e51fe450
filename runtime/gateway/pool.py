"""One function's instances: scale from zero, bounded queue, replacement, idle scale-to-zero.

Invariants (all state is touched from the event loop only, so no locks)::

    slots          every instance this pool started and has not retired, by state:
                   starting (executor.start / wait_ready running), ready, draining
    waiters        FIFO of requests waiting for a slot; len(waiters) <= scaling.queue_size
    slot.inflight  requests an instance is answering; <= scaling.concurrency

A request takes a free ready slot at once, else queues (429 when the queue is full) and the
pool starts instances up to ``max_instances`` for the queued demand. When a slot frees or an
instance becomes ready, :meth:`_dispatch` hands it to the oldest waiter. An instance that dies
is retired: its in-flight requests get 502 with the executor's reason and a replacement starts
when there is demand or ``min_instances`` asks for it. A request that times out (504) retires
its instance too, since a hung handler would otherwise hold the slot forever. A function with
no instance, whose start the node's memory has no room for (Note [memory admission] in
trims.runtime.gateway.budget), answers its queued requests 503 with Retry-After. So does one
whose start the model store refused for capacity (``resource_exhausted``) when no idle
instance is left to stop; while one is, the start is retried once it has stopped (Note
[starts refused for capacity], same module). Such a start is not the function's failure: it
is not counted as one, and the function's readiness stays as it was.

Note [standby instances]: with ``scaling.standby`` k > 0 (and an executor that has
``start_standby``: local, docker) the pool keeps k instances prepared but not started: the
worker has started (forked, or its container), dropped its privileges, acquired and mapped its
models, filled their page tables and imported the function's code (and runs no kernel: Note
[standby warm-up] in trims.runtime.executors.warmup), then waits without running ``init``
(state "standby", not counted in ``min_instances``/``max_instances`` and never given a
request). A scale-up takes the oldest prepared standby instead of starting an instance: only
``init`` runs (ACTIVATE on the wire), so the cold start costs what MLServer's model load into
a running server costs, and the first request finds the weights already mapped. The standby
is replaced on the reaper's first tick at least ``standby_refill_s`` (1 s) after the
activated instance is ready, not sooner: the replacement's preparation would compete for the
CPU with the first requests (measured with bench/peers.py). Standbys count in the node's
instance budget but are started only where there is room (never by evicting an instance); at
the limit, a pool that needs room drops a standby before an idle instance is evicted. A
standby that dies is replaced on the reaper's tick. Three failed preparations in a row stop
the refills (logged) until an instance of the function starts: a broken function never
becomes a start loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import statistics
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from opentelemetry import trace

from trims.errors import (
    QueueFull,
    ResourceExhausted,
    Timeout,
    TrimsError,
    Unavailable,
    UpstreamError,
)
from trims.runtime.executors.base import Executor, Instance, StandbyExecutor
from trims.runtime.functions.spec import FunctionSpec
from trims.runtime.gateway.budget import Admission, InstanceBudget
from trims.runtime.gateway.memory import private_bytes
from trims.runtime.gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

T = TypeVar("T")

STATES = ("standby", "starting", "ready", "draining")
#: Failed standby preparations in a row after which none is prepared until an instance starts.
_STANDBY_FAILURES = 3
#: Executions whose mean is the service time a 429's Retry-After is worked out from: enough to
#: smooth one odd request, few enough to follow a change of load within a queue's worth.
_RECENT_EXECUTIONS = 16
#: The service time assumed before any request finished (the queue fills while instances
#: start, and a cold start takes seconds).
_UNMEASURED_SERVICE_S = 1.0
#: Instances whose private memory gives the function's expected instance cost (a median):
#: the recent ones, kept after they stop, since a function scaled to zero starts again.
_MEASURED_INSTANCES = 8
#: Seconds between measurements of a ready instance's private memory (it grows as it serves).
_REMEASURE_S = 10.0
#: Why requests are refused with 503 for want of room (trims_admissions_refused_total's
#: reasons): the gateway's memory (Note [memory admission] in trims.runtime.gateway.budget),
#: the model store's (Note [starts refused for capacity], same module).
_REFUSALS = ("memory", "store")


@dataclass(eq=False)
class Slot:
    """An instance as the pool sees it."""

    id: str
    state: str = "starting"
    instance: Instance | None = None
    inflight: int = 0
    served: int = 0
    last_used: float = field(default_factory=time.monotonic)
    #: Unix epoch ns the pool asked for this instance, and when it became ready (None: not
    #: yet): a traced request that waited for it shows the start as its own span.
    started_ns: int = field(default_factory=time.time_ns)
    ready_ns: int | None = None
    #: A standby whose preparation finished (Note [standby instances]).
    prepared: bool = False
    #: When (monotonic) its private memory was last measured; None: never.
    measured_at: float | None = None

    def describe(self) -> dict[str, Any]:
        inst = self.instance
        out = {
            "id": self.id,
            "state": self.state,
            "inflight": self.inflight,
            "served": self.served,
            "alive": bool(inst is not None and inst.alive()),
            "executor": inst.executor if inst is not None else None,
        }
        if self.state == "standby":
            out["prepared"] = self.prepared
        return out


class Pool:
    """The instances of one function and the queue in front of them."""

    _ids = itertools.count(1)

    def __init__(
        self,
        spec: FunctionSpec,
        executor: Executor,
        metrics: GatewayMetrics,
        *,
        budget: InstanceBudget | None = None,
        start_timeout_s: float = 120.0,
        stop_grace_s: float = 5.0,
        standby_refill_s: float = 1.0,
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self._executor = executor
        self._budget = budget or InstanceBudget(None)
        self._scaling = spec.scaling
        self._start_timeout_s = start_timeout_s
        self._stop_grace_s = stop_grace_s
        #: Seconds after an activated standby is ready before its replacement may be prepared.
        self._standby_refill_s = standby_refill_s
        self._refill_after = 0.0
        self.slots: list[Slot] = []
        self._waiters: deque[asyncio.Future[Slot]] = deque()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._busy = 0
        self._idle = asyncio.Event()
        self._idle.set()
        #: The last execution times, seconds (Retry-After's service time).
        self._recent_exec_s: deque[float] = deque(maxlen=_RECENT_EXECUTIONS)
        #: Private memory of the recent instances, bytes (the budget's instance cost).
        self._private_bytes: deque[int] = deque(maxlen=_MEASURED_INSTANCES)
        self._start_failures = 0
        self._standby_failures = 0
        self._start_standby = (
            executor.start_standby if isinstance(executor, StandbyExecutor) else None
        )
        #: Why the last instance start failed; None once one starts (the model's readiness).
        self.start_error: str | None = None
        self._reaper: asyncio.Task[None] | None = None
        fn = spec.name
        self._m_queue = metrics.queue_wait.labels(fn)
        self._m_cold = metrics.cold_start.labels(fn)
        self._m_exec = metrics.execution.labels(fn)
        self._m_cold_starts = metrics.cold_starts.labels(fn)
        self._m_failures = metrics.instance_failures.labels(fn)
        self._m_acquire = metrics.model_acquire.labels(fn)
        #: reason -> the refused admissions counter's child (Pool._refuse_waiters).
        self._m_refused = {r: metrics.admissions_refused.labels(fn, r) for r in _REFUSALS}
        self._m_invocations = metrics.invocations
        #: status -> the invocation counter's child (labels() costs a lookup per request).
        self._m_by_status: dict[str, Any] = {}
        #: The version the Open Inference Protocol names (the metrics' ``version`` label).
        self.version = spec.serves.versions[0] if spec.serves is not None else "1"
        self._metrics = metrics
        self._m_exec_count = metrics.inference_exec_count.labels(fn, self.version)
        self._m_samples = metrics.inference_count.labels(fn, self.version)
        #: (protocol, outcome) -> (request counter, duration histogram) children.
        self._m_requests: dict[tuple[str, str], tuple[Any, Any]] = {}

    @property
    def pending(self) -> int:
        """Requests waiting for an instance slot."""
        return len(self._waiters)

    def count_invocation(
        self, status: str, *, protocol: str = "v1", samples: int = 1, started: float | None = None
    ) -> None:
        """Count one finished request of this function by its status ("200", "429", ...) and
        protocol (``v1`` invoke, ``v2`` infer): ``samples`` inferred when it succeeded, its
        end-to-end time from ``started`` (``time.monotonic()``) when given."""
        child = self._m_by_status.get(status)
        if child is None:
            child = self._m_by_status[status] = self._m_invocations.labels(self.name, status)
        child.inc()
        success = status.startswith("2")
        key = (protocol, "success" if success else "failure")
        children = self._m_requests.get(key)
        if children is None:
            m = self._metrics
            children = self._m_requests[key] = (
                m.inference_requests.labels(self.name, self.version, *key),
                m.inference_duration.labels(self.name, self.version, protocol),
            )
        children[0].inc()
        if started is not None:
            children[1].observe(time.monotonic() - started)
        if success:
            self._m_samples.inc(samples)

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the background reaper and the ``min_instances`` warm instances."""
        if self._reaper is not None:
            raise RuntimeError(f"pool of {self.name} started twice")
        self._reaper = asyncio.create_task(self._reap_forever(), name=f"trims-reaper-{self.name}")
        self._budget.register(self)
        self._ensure_min()
        self._fill_standby()

    async def close(self, drain_timeout_s: float) -> None:
        """Refuse new requests, let queued and in-flight ones finish, then stop every instance."""
        self._closed = True
        try:
            await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
        except TimeoutError:
            log.warning(
                "function %s: %d requests still running after %.1fs drain; stopping instances",
                self.name,
                self._busy,
                drain_timeout_s,
            )
        if self._reaper is not None:
            self._reaper.cancel()
        for fut in self._waiters:
            if not fut.done():
                fut.set_exception(Unavailable(f"function {self.name} was removed; deploy it again"))
        self._waiters.clear()
        for task in list(self._tasks):
            task.cancel()
        slots, self.slots = self.slots, []
        await asyncio.gather(*(self._stop_slot(s) for s in slots), return_exceptions=True)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._reaper is not None:
            await asyncio.gather(self._reaper, return_exceptions=True)
        self._budget.unregister(self)
        self._budget.capacity_changed()

    # -- the request path ----------------------------------------------------------------------

    async def run(
        self,
        call: Callable[[Instance, float], Awaitable[T]],
        *,
        deadline: float | None = None,
    ) -> T:
        """Run ``call(instance, timeout_s)`` on a slot, queueing (and scaling) as needed."""
        if self._closed:
            raise Unavailable(f"function {self.name} is shutting down; retry on another gateway")
        if deadline is None:
            deadline = time.monotonic() + self._scaling.request_timeout_s
        self._busy += 1
        self._idle.clear()
        try:
            arrived = time.monotonic()
            slot = self._take_free()
            if slot is None:
                with tracer.start_as_current_span("queue", attributes={"function": self.name}):
                    slot = await self._wait_for_slot(deadline)
            self._m_queue.observe(time.monotonic() - arrived)
            return await self._call(slot, call, deadline)
        finally:
            self._busy -= 1
            if self._busy == 0:
                self._idle.set()

    async def _call(
        self, slot: Slot, call: Callable[[Instance, float], Awaitable[T]], deadline: float
    ) -> T:
        instance = slot.instance
        assert instance is not None
        started = time.monotonic()
        try:
            return await call(instance, max(deadline - started, 0.001))
        except Timeout:
            self._retire(slot, "a request timed out; the instance is recycled")
            raise
        except UpstreamError:
            if not instance.alive():
                self._retire(slot, instance.exit_reason or "the instance died")
            raise
        finally:
            elapsed = time.monotonic() - started
            self._m_exec.observe(elapsed)
            self._m_exec_count.inc()
            self._recent_exec_s.append(elapsed)
            slot.inflight -= 1
            slot.served += 1
            slot.last_used = time.monotonic()
            if slot.state == "ready":
                self._dispatch()
                if slot.inflight == 0 and self._budget.bounded:
                    self._budget.capacity_changed()

    def _take_free(self) -> Slot | None:
        """A ready slot with spare concurrency when nobody queues before us, else None."""
        if self._waiters:
            return None
        slot = self._free_slot()
        if slot is not None:
            slot.inflight += 1
        return slot

    def _free_slot(self) -> Slot | None:
        best: Slot | None = None
        limit = self._scaling.concurrency
        for slot in self.slots:
            if slot.state != "ready" or slot.inflight >= limit:
                continue
            instance = slot.instance
            if instance is None or not instance.alive():
                self._retire(slot, (instance.exit_reason if instance else None) or "it died")
                return self._free_slot()
            if best is None or slot.inflight < best.inflight:
                best = slot
        return best

    async def _wait_for_slot(self, deadline: float) -> Slot:
        if len(self._waiters) >= self._scaling.queue_size:
            raise QueueFull(
                f"function {self.name} has {len(self._waiters)} requests queued "
                f"(queue_size {self._scaling.queue_size}); retry after the Retry-After seconds",
                retry_after_s=self._retry_after_s(),
            )
        fut: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._scale_up()
        try:
            async with asyncio.timeout_at(_loop_time(deadline)):
                return await fut
        except TimeoutError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._give_back(fut.result())
            raise Timeout(
                f"function {self.name} found no free instance within its request timeout "
                f"({self._scaling.request_timeout_s:g}s); raise max_instances or the timeout"
            ) from None
        finally:
            if not fut.done():
                fut.cancel()
            try:
                self._waiters.remove(fut)
            except ValueError:
                pass

    def _give_back(self, slot: Slot) -> None:
        slot.inflight -= 1
        if slot.state == "ready":
            self._dispatch()

    def _dispatch(self) -> None:
        while self._waiters:
            slot = self._free_slot()
            if slot is None:
                return
            fut = self._waiters.popleft()
            if fut.done():
                continue
            slot.inflight += 1
            fut.set_result(slot)

    def _retry_after_s(self) -> int:
        """A full queue's Retry-After: the seconds the queue needs, its length times the mean
        of the recent execution times over the ready instances' request slots; at least 1, at
        most the request timeout (by then every request queued now has been answered or timed
        out)."""
        recent = self._recent_exec_s
        service_s = sum(recent) / len(recent) if recent else _UNMEASURED_SERVICE_S
        capacity = max(1, sum(1 for s in self.slots if s.state == "ready"))
        capacity *= self._scaling.concurrency
        estimate = len(self._waiters) * service_s / capacity
        return max(1, min(math.ceil(self._scaling.request_timeout_s), math.ceil(estimate)))

    # -- scaling -------------------------------------------------------------------------------

    def _active(self) -> int:
        return sum(1 for s in self.slots if s.state in ("starting", "ready"))

    def _scale_up(self) -> None:
        if self._closed and not self._waiters:
            return
        concurrency = self._scaling.concurrency
        starting = sum(1 for s in self.slots if s.state == "starting")
        unserved = len(self._waiters) - starting * concurrency
        admission = Admission.START
        while unserved > 0 and self._active() < self._scaling.max_instances:
            admission = self._start_one()
            if admission is not Admission.START:
                break
            unserved -= concurrency
        if admission is Admission.REFUSE and self._active() == 0:
            self._refuse_waiters(
                "memory",
                "the node's memory is at its high watermark with no idle instance to stop; "
                "retry after the Retry-After seconds (or give the gateway's memory cgroup more "
                "memory)",
            )

    def _ensure_min(self) -> None:
        if self._closed:
            return
        while self._active() < self._scaling.min_instances and self._start_one() is Admission.START:
            pass

    def _start_one(self) -> Admission:
        """Start an instance: a prepared standby, else a new one if the node budget allows
        (and no start of this function waits for room: Note [starts refused for capacity])."""
        if self._budget.awaiting_room(self):
            return Admission.WAIT
        if self._activate_standby():
            return Admission.START
        admission = self._budget.try_start(self)
        if admission is Admission.START:
            self._start_instance()
        return admission

    def _refuse_waiters(self, reason: str, why: str) -> None:
        """No instance of this function runs or starts, and the node has no room for one (the
        gateway's memory: Note [memory admission] in trims.runtime.gateway.budget; the model
        store: Note [starts refused for capacity], same module): the queued requests get 503
        with Retry-After rather than waiting for room that may not come. ``reason`` is the
        refusal metric's label, ``why`` the rest of the message."""
        retry_after_s = self._retry_after_s()
        err = Unavailable(
            f"function {self.name} has no instance and {why}", retry_after_s=retry_after_s
        )
        waiters, self._waiters = self._waiters, deque()
        refused = 0
        for fut in waiters:
            if not fut.done():
                fut.set_exception(err)
                refused += 1
        self._m_refused[reason].inc(refused)
        log.warning(
            "function %s: %d request(s) refused with 503 (%s): no room for an instance and "
            "none idle to stop (Retry-After %ds)", self.name, refused, reason, retry_after_s,
        )  # fmt: skip

    def _new_slot(self, state: str) -> Slot:
        slot = Slot(id=f"{self.name}-{next(self._ids)}-{uuid.uuid4().hex[:6]}", state=state)
        self.slots.append(slot)
        return slot

    def _start_instance(self) -> None:
        slot = self._new_slot("starting")
        self._spawn(self._start(slot), f"start-{slot.id}")

    # -- standby instances (Note [standby instances]) -------------------------------------------

    def _activate_standby(self) -> bool:
        """Start the oldest prepared standby; False if there is none."""
        for slot in self.slots:
            if slot.state == "standby" and slot.prepared:
                inst = slot.instance
                if inst is None or not inst.alive():
                    continue  # the reaper replaces it
                slot.state = "starting"
                slot.started_ns = time.time_ns()
                self._spawn(self._start(slot, activate=True), f"activate-{slot.id}")
                return True
        return False

    def _fill_standby(self) -> None:
        """Prepare standbys up to ``scaling.standby`` where the node budget has room."""
        start_standby = self._start_standby
        if start_standby is None or self._closed or self._standby_failures >= _STANDBY_FAILURES:
            return
        if time.monotonic() < self._refill_after:
            return
        have = sum(1 for s in self.slots if s.state == "standby")
        while have < self._scaling.standby and self._budget.has_room(self):
            slot = self._new_slot("standby")
            self._spawn(self._prepare(slot, start_standby), f"standby-{slot.id}")
            have += 1

    async def _prepare(self, slot: Slot, start_standby: Callable[..., Awaitable[Instance]]) -> None:
        started = time.monotonic()
        try:
            slot.instance = await start_standby(self.spec, slot.id)
            if slot.state == "standby":  # else dropped (drop_standby) while it started
                await slot.instance.wait_standby(self._start_timeout_s)
        except asyncio.CancelledError:
            await self._stop_slot(slot)
            raise
        except Exception as e:
            if slot.state != "standby":  # dropped meanwhile: its stop ended the preparation
                await self._stop_slot(slot)
                return
            self._standby_failures += 1
            reason = e.message if isinstance(e, TrimsError) else f"{type(e).__name__}: {e}"
            log.warning("function %s: standby %s failed to prepare (%d in a row): %s%s",
                        self.name, slot.id, self._standby_failures, reason,
                        "; no more standbys until an instance starts"
                        if self._standby_failures >= _STANDBY_FAILURES else "")  # fmt: skip
            slot.state = "draining"
            await self._stop_slot(slot)
            return
        if slot.state != "standby":
            await self._stop_slot(slot)  # dropped while it started: stop what it started
            return
        self._standby_failures = 0
        slot.prepared = True
        log.info("function %s: standby %s prepared in %.3fs",
                 self.name, slot.id, time.monotonic() - started)  # fmt: skip
        if self._closed:
            slot.state = "draining"
            await self._stop_slot(slot)
        elif self._waiters:
            self._scale_up()  # demand arrived while it prepared

    def drop_standby(self, reason: str) -> bool:
        """Stop one standby to make room in the node budget (``reason``: the stop metric's
        label); False if this pool has none."""
        for slot in self.slots:
            if slot.state == "standby":
                log.info("function %s: standby %s stopped to make room (%s)",
                         self.name, slot.id, reason)  # fmt: skip
                self._stop_healthy(slot, reason)
                return True
        return False

    async def _start(self, slot: Slot, *, activate: bool = False) -> None:
        """Start ``slot``'s instance, or with ``activate`` run its prepared standby's init
        (Note [standby instances])."""
        started = time.monotonic()
        attributes: dict[str, Any] = {"function": self.name, "instance": slot.id}
        if activate:
            attributes["standby"] = True
        with tracer.start_as_current_span("instance start", attributes=attributes) as span:
            try:
                if activate:
                    assert slot.instance is not None
                    await slot.instance.activate(self._start_timeout_s)
                else:
                    slot.instance = await self._executor.start(self.spec, slot.id)
                    await slot.instance.wait_ready(self._start_timeout_s)
            except asyncio.CancelledError:
                await self._stop_slot(slot)
                raise
            except Exception as e:
                span.record_exception(e)
                self._start_failed(slot, e)
                return
        await self._started(slot, started)
        if activate:
            self._refill_after = time.monotonic() + self._standby_refill_s
            self._fill_standby()  # at once only without a delay; else on a reaper tick

    async def _started(self, slot: Slot, started: float) -> None:
        """``slot``'s instance finished its start (begun at monotonic ``started``)."""
        elapsed = time.monotonic() - started
        self._start_failures = 0
        self._standby_failures = 0
        self.start_error = None
        self._m_cold.observe(elapsed)
        self._m_cold_starts.inc()
        acquire_s = getattr(slot.instance, "model_acquire_s", None)
        if acquire_s is not None:
            self._m_acquire.observe(acquire_s)
        if slot.state != "starting":
            await self._stop_slot(slot)
            return
        slot.state = "ready"
        slot.last_used = time.monotonic()
        slot.ready_ns = time.time_ns()
        self._measure(slot)
        log.info("function %s: instance %s ready in %.3fs", self.name, slot.id, elapsed)
        self._dispatch()
        if self._closed and not self._waiters and slot.inflight == 0:
            slot.state = "draining"
            await self._stop_slot(slot)

    def _start_failed(self, slot: Slot, exc: Exception) -> None:
        if isinstance(exc, ResourceExhausted):
            self._start_refused(slot, exc)
            return
        self._m_failures.inc()
        self._start_failures += 1
        if isinstance(exc, TrimsError):
            err: TrimsError = exc
        else:
            err = UpstreamError(f"instance {slot.id} of {self.name} failed to start: {exc}")
        log.warning("function %s: instance %s failed to start: %s", self.name, slot.id, err)
        self.start_error = err.message
        slot.state = "draining"
        self._spawn(self._stop_slot(slot), f"stop-{slot.id}")
        if self._active() == 0:
            waiters, self._waiters = self._waiters, deque()
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(_as_upstream(err, self.name))

    def _start_refused(self, slot: Slot, err: ResourceExhausted) -> None:
        """``slot``'s start was refused for capacity (Note [starts refused for capacity] in
        trims.runtime.gateway.budget): room is made and the start retried, or with nothing to
        stop the requests no instance serves get 503; the function's failure count and
        readiness are left alone, a broken function's and not a full node's."""
        # Counted among the starts failed in a row all the same: the reaper retries
        # min_instances only below three, or a full node would see a start every tick.
        self._start_failures += 1
        making_room = self._budget.make_room(self, "store_capacity")
        log.warning("function %s: instance %s refused for capacity (%s); %s", self.name, slot.id,
                    err.message, "retrying once room is made" if making_room
                    else "nothing idle to stop")  # fmt: skip
        slot.state = "draining"
        self._spawn(self._stop_slot(slot), f"stop-{slot.id}")
        if not making_room and self._active() == 0:
            self._refuse_waiters(
                "store",
                "the model store has no room for its models with no idle instance to stop "
                f"({err.message}); retry after the Retry-After seconds (or give the store's "
                "cpu tier a larger budget)",
            )

    def _retire(self, slot: Slot, reason: str) -> None:
        if slot.state == "draining":
            return
        slot.state = "draining"
        self._m_failures.inc()
        log.warning(
            "function %s: instance %s retired (%s); replacing it", self.name, slot.id, reason
        )
        self._spawn(self._stop_slot(slot, grace_s=0.5), f"stop-{slot.id}")
        self._ensure_min()
        self._scale_up()

    async def _stop_slot(self, slot: Slot, grace_s: float | None = None) -> None:
        instance, slot.instance = slot.instance, None
        try:
            if instance is not None:
                grace = self._stop_grace_s if grace_s is None else grace_s
                await self._executor.stop(instance, grace)
        except Exception:
            log.exception("function %s: stopping instance %s failed", self.name, slot.id)
        finally:
            if slot in self.slots and slot.instance is None:
                self.slots.remove(slot)
                self._budget.capacity_changed()

    def _spawn(self, coro: Awaitable[Any], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(f"trims-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reap_forever(self) -> None:
        """Stop idle instances beyond ``min_instances``; replace dead ones."""
        idle_s = self._scaling.idle_timeout_s
        tick = max(0.05, min(1.0, idle_s / 4))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for slot in list(self.slots):
                if slot.state == "standby" and slot.prepared:
                    self._drop_dead_standby(slot)
                if slot.state != "ready":
                    continue
                inst = slot.instance
                if inst is None or not inst.alive():
                    reason = inst.exit_reason if inst is not None else None
                    self._retire(slot, reason or "it died")
                    continue
                if slot.measured_at is None or now - slot.measured_at >= _REMEASURE_S:
                    self._measure(slot)
                if (
                    slot.inflight == 0
                    and now - slot.last_used >= idle_s
                    and self._active() > self._scaling.min_instances
                ):
                    idle_for = now - slot.last_used
                    log.info(
                        "function %s: instance %s idle for %.1fs; stopping it",
                        self.name,
                        slot.id,
                        idle_for,
                    )
                    self._stop_healthy(slot, "idle_timeout")
            if self._start_failures < 3:
                self._ensure_min()
            self._fill_standby()

    def _drop_dead_standby(self, slot: Slot) -> None:
        inst = slot.instance
        if inst is not None and inst.alive():
            return
        reason = (inst.exit_reason if inst is not None else None) or "it died"
        log.warning("function %s: standby %s ended (%s); replacing it", self.name, slot.id, reason)
        slot.state = "draining"
        self._spawn(self._stop_slot(slot, grace_s=0.5), f"stop-{slot.id}")

    # -- the node budget (see budget.py) ----------------------------------------------------------

    def instance_total(self) -> int:
        return len(self.slots)

    def instance_draining(self) -> int:
        return sum(1 for s in self.slots if s.state == "draining")

    def instance_starting(self) -> int:
        return sum(
            1
            for s in self.slots
            if s.state == "starting" or (s.state == "standby" and not s.prepared)
        )

    def instance_memory(self) -> int | None:
        measured = self._private_bytes
        return int(statistics.median(measured)) if measured else None

    def _measure(self, slot: Slot) -> None:
        """Note ``slot``'s private memory for the budget's instance cost, where the budget
        caps by memory. Only the local executor's workers are measured: they are this
        gateway's processes, in its pid namespace and its memory cgroup; a container's pid is
        its own namespace's and its memory is charged elsewhere."""
        inst = slot.instance
        if self._budget.memory is None or inst is None or inst.executor != "local":
            return
        pid = getattr(inst, "pid", None)
        measured = private_bytes(pid) if isinstance(pid, int) else None
        slot.measured_at = time.monotonic()
        if measured is not None:
            self._private_bytes.append(measured)

    def _stop_healthy(self, slot: Slot, reason: str) -> None:
        """Stop a healthy instance or standby for ``reason`` (the stop metric's label)."""
        self._metrics.instance_stops.labels(self.name, reason).inc()
        slot.state = "draining"
        self._spawn(self._stop_slot(slot), f"stop-{slot.id}")

    def _idle_slot(self) -> Slot | None:
        if self._active() <= self._scaling.min_instances:
            return None
        idle = [s for s in self.slots if s.state == "ready" and s.inflight == 0]
        return min(idle, key=lambda s: s.last_used) if idle else None

    def idle_since(self) -> float | None:
        slot = self._idle_slot()
        return slot.last_used if slot is not None else None

    def evict_idle(self, reason: str) -> None:
        slot = self._idle_slot()
        if slot is None:
            return
        log.info("function %s: instance %s stopped to make room for another (%s)",
                 self.name, slot.id, reason)  # fmt: skip
        self._stop_healthy(slot, reason)

    def holds_models(self) -> bool:
        return bool(self.spec.models)

    def wants_instances(self) -> bool:
        return bool(self._waiters)

    def retry_scale_up(self) -> None:
        self._scale_up()

    # -- introspection -------------------------------------------------------------------------

    def start_window(self, instance_id: str) -> tuple[int, int] | None:
        """(asked, ready) Unix epoch ns of an instance's start; None when not known (traces)."""
        for slot in self.slots:
            if slot.id == instance_id and slot.ready_ns is not None:
                return slot.started_ns, slot.ready_ns
        return None

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATES, 0)
        for slot in self.slots:
            out[slot.state] += 1
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "instances": [s.describe() for s in self.slots],
            "queued": len(self._waiters),
            "inflight": sum(s.inflight for s in self.slots),
        }


def _as_upstream(err: TrimsError, function: str) -> TrimsError:
    if isinstance(err, UpstreamError | Timeout):
        return err
    return UpstreamError(f"function {function} could not start an instance: {err.message}")


def _loop_time(deadline_monotonic: float) -> float:
    loop = asyncio.get_running_loop()
    return loop.time() + (deadline_monotonic - time.monotonic())
