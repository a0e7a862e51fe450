"""An executor whose instances run Python callables in the gateway's own event loop.

What httpx's ``MockTransport`` is to its network layer, this is to the executors: a real
implementation of :class:`~trims.runtime.executors.base.Executor` with no process, socket or
container behind it, so that what stands above (the gateway's pool, its scaling and error
paths) runs and is tested in milliseconds without patching anything.

A function is an :class:`InProcessFunction`: optional ``init`` (awaited by ``wait_ready``, or
by ``activate`` for a standby), ``prepare`` (a standby's ``wait_standby``), ``invoke(body,
headers)`` and ``infer(inputs)``. Instances keep the error contract of
``base.py``: a crashed instance (:meth:`InProcessInstance.crash`) fails its in-flight and later
requests with ``UpstreamError("instance <id> of <fn> died: <reason>")``, a request past its
timeout raises ``Timeout`` (the instance stays up), a handler that raises gives
``UpstreamError`` naming the exception (a trims error passes through as it is).

Every lifecycle step (start, ready, request begun and ended, crash, stop) wakes the awaiters of
:meth:`InProcessExecutor.until`, so a test orders events by awaiting them, never by sleeping.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from trims.errors import NotFound, Timeout, TrimsError, UpstreamError, ValidationError
from trims.runtime.executors.base import Instance, Reply

if TYPE_CHECKING:
    import numpy as np

    from trims.runtime.functions.spec import FunctionSpec

__all__ = ["InProcessExecutor", "InProcessFunction", "InProcessInstance"]

R = TypeVar("R")

InitHandler = Callable[["InProcessInstance"], Awaitable[None]]
InvokeHandler = Callable[[bytes, Mapping[str, str]], Awaitable["Reply | bytes"]]
InferHandler = Callable[[Mapping[str, "np.ndarray"]], Awaitable[dict[str, "np.ndarray"]]]


@dataclass(frozen=True)
class InProcessFunction:
    """The callables of one function; those left None answer as a worker without them would."""

    invoke: InvokeHandler | None = None
    infer: InferHandler | None = None
    #: Awaited by ``wait_ready`` (the worker's ``init(ctx)``); raising fails the start.
    init: InitHandler | None = None
    #: Awaited by a standby's ``wait_standby`` (the worker's model acquire and import);
    #: raising fails the standby.
    prepare: InitHandler | None = None


class InProcessInstance(Instance):
    """One instance: its requests are tasks in the caller's event loop."""

    def __init__(
        self, instance_id: str, function: str, code: InProcessFunction, changed: Callable[[], None]
    ) -> None:
        self.id = instance_id
        self.function = function
        self.executor = "inprocess"
        self.started_at = time.time()
        self.code = code
        self.ready = False
        #: A standby that ``wait_standby`` found prepared (init not run until ``activate``).
        self.prepared = False
        self.exit_reason: str | None = None
        #: Requests begun and finished (any outcome) on this instance.
        self.begun = 0
        self.finished = 0
        self._inflight: set[asyncio.Task[Any]] = set()
        self._ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.changed = changed

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def alive(self) -> bool:
        return self.exit_reason is None

    def crash(self, reason: str = "killed by SIGKILL") -> None:
        """End the instance now as if its process died: in-flight requests fail at once."""
        if self.exit_reason is not None:
            return
        self.exit_reason = reason
        self._ended.set_result(reason)
        for task in self._inflight:
            task.cancel()
        self.changed()

    def _died(self) -> UpstreamError:
        return UpstreamError(
            f"instance {self.id} of {self.function} died: {self.exit_reason}", instance=self.id
        )

    async def _run(self, what: str, work: Callable[[], Awaitable[R]], timeout: float) -> R:
        """Run ``work()`` as a task racing the instance's end and ``timeout``."""
        if self.exit_reason is not None:
            raise self._died()
        task: asyncio.Task[R] = asyncio.ensure_future(work())
        self._inflight.add(task)
        self.begun += 1
        self.changed()
        try:
            racers: set[asyncio.Future[Any]] = {task, self._ended}
            done, _ = await asyncio.wait(
                racers, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if task not in done:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                if self._ended in done:
                    raise self._died()
                raise Timeout(
                    f"function {self.function} did not answer within {timeout:.1f} s "
                    f"(instance {self.id})"
                )
            if task.cancelled():
                raise self._died()
            error = task.exception()
            if error is None:
                return task.result()
            if isinstance(error, TrimsError):
                raise error
            raise UpstreamError(
                f"{what} of {self.function} raised {type(error).__name__}: {error}"
            ) from error
        finally:
            if not task.done():
                task.cancel()
            self._inflight.discard(task)
            self.finished += 1
            self.changed()

    async def wait_standby(self, timeout: float) -> None:
        """Run the function's ``prepare`` (if any); the instance is then a prepared standby."""
        await self._start_step("prepare", self.code.prepare, timeout)
        self.prepared = True
        self.changed()

    async def activate(self, timeout: float) -> None:
        await self.wait_ready(timeout)

    async def wait_ready(self, timeout: float) -> None:
        await self._start_step("init", self.code.init, timeout)
        self.ready = True
        self.changed()

    async def _start_step(self, what: str, step: InitHandler | None, timeout: float) -> None:
        """Run ``step`` (init or prepare) as a worker would: its failure ends the instance."""
        if step is not None:
            try:
                await self._run(what, lambda: step(self), timeout)
            except Timeout:
                raise Timeout(
                    f"instance {self.id} of {self.function} did not finish {what} within "
                    f"{timeout:.1f} s"
                ) from None
            except UpstreamError as e:
                if self.exit_reason is None:
                    self.exit_reason = f"init failed: {e.message}"
                    self._ended.set_result(self.exit_reason)
                    self.changed()
                raise UpstreamError(
                    f"instance {self.id} of {self.function} failed to start: {e.message}"
                ) from e
        if self.exit_reason is not None:
            raise self._died()

    async def invoke(
        self,
        body: bytes,
        headers: Mapping[str, str],
        *,
        timeout: float,
        trace: Mapping[str, str],
    ) -> Reply:
        handler = self.code.invoke
        if handler is None:
            raise UpstreamError(f"function {self.function} has no HTTP handler (invoke)")
        out = await self._run("handler", lambda: handler(body, headers), timeout)
        return out if isinstance(out, Reply) else Reply(200, body=bytes(out))

    async def infer(
        self, inputs: Mapping[str, np.ndarray], *, timeout: float, trace: Mapping[str, str]
    ) -> dict[str, np.ndarray]:
        handler = self.code.infer
        if handler is None:
            raise UpstreamError(f"function {self.function} defines no infer(inputs)")
        return await self._run("infer", lambda: handler(inputs), timeout)

    async def terminate(self, grace_s: float) -> None:
        """Let in-flight requests finish for up to ``grace_s``, then end the rest (SIGKILL)."""
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=grace_s)
        if self._inflight:
            self.crash(f"killed by SIGKILL after a {grace_s:g} s drain")
        elif self.exit_reason is None:
            self.exit_reason = "stopped"
            self._ended.set_result(self.exit_reason)
            self.changed()


class InProcessExecutor:
    """Instances of the functions in ``functions`` (by function name), in this event loop.

    Besides the executor interface it keeps what a test awaits: ``started`` (every instance in
    start order), ``stopped`` (the ids of those stopped through :meth:`stop`) and
    :meth:`until`.
    """

    name = "inprocess"

    def __init__(self, functions: Mapping[str, InProcessFunction]) -> None:
        self.functions = dict(functions)
        self.started: list[InProcessInstance] = []
        self.stopped: list[str] = []
        self._live: dict[str, InProcessInstance] = {}
        self._waiters: list[asyncio.Future[None]] = []
        self._closed = False

    def check(self, spec: FunctionSpec) -> None:
        if spec.name not in self.functions:
            raise ValidationError(
                f"no in-process function named {spec.name!r}; give the InProcessExecutor one "
                f"(it has: {', '.join(sorted(self.functions)) or 'none'})",
                field="name",
            )

    async def start_standby(self, spec: FunctionSpec, instance_id: str) -> InProcessInstance:
        """An instance whose ``init`` waits for :meth:`InProcessInstance.activate`."""
        return await self.start(spec, instance_id)

    async def start(self, spec: FunctionSpec, instance_id: str) -> InProcessInstance:
        if self._closed:
            raise RuntimeError("the in-process executor is closed; make a new one")
        self.check(spec)
        instance = InProcessInstance(
            instance_id, spec.name, self.functions[spec.name], self.changed
        )
        self._live[instance_id] = instance
        self.started.append(instance)
        self.changed()
        return instance

    async def stop(self, instance: Instance, grace_s: float = 10.0) -> None:
        managed = self._live.pop(instance.id, None)
        if managed is None:
            raise NotFound(f"instance {instance.id} is not managed by this inprocess executor")
        await managed.terminate(grace_s)
        self.stopped.append(managed.id)
        self.changed()

    async def close(self) -> None:
        self._closed = True
        live, self._live = list(self._live.values()), {}
        await asyncio.gather(*(i.terminate(0.0) for i in live))
        self.stopped.extend(i.id for i in live)
        self.changed()

    def live(self) -> list[InProcessInstance]:
        """Instances started and not yet stopped, in start order."""
        return [i for i in self.started if i.id in self._live]

    async def until(
        self, predicate: Callable[[], bool], what: str = "", limit_s: float = 10.0
    ) -> None:
        """Return once ``predicate()`` holds, re-checked at every lifecycle step.

        ``limit_s`` only turns a hang (a predicate that never holds) into an error that says
        ``what`` was awaited; nothing waits for it to pass.
        """
        try:
            async with asyncio.timeout(limit_s):
                while not predicate():
                    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                    self._waiters.append(fut)
                    await fut
        except TimeoutError:
            raise AssertionError(
                f"still waiting after {limit_s:g} s for {what or predicate}"
            ) from None

    def changed(self) -> None:
        """Wake the :meth:`until` awaiters; an in-process function whose own state a test
        awaits calls this when that state changes."""
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
