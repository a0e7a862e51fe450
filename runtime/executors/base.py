"""The executor interface: start/stop function instances; invoke them over the wire protocol.

An :class:`Executor` makes instances (processes, containers, pods); an :class:`Instance` is one
of them. The gateway sees nothing else. :class:`WorkerInstance` implements everything an
instance does over the worker's wire protocol, so an executor only says how to reach the
worker (:meth:`WorkerInstance.address`) and how the process ended
(:meth:`WorkerInstance.wait_exit_reason`).

Error contract (what the gateway relies on):

* the worker died before or during a request -> ``UpstreamError("instance <id> of <fn> died:
  <reason>")`` and ``exit_reason`` is set (e.g. "killed by SIGSEGV", "out of memory");
* init failed -> ``wait_ready`` raises ``UpstreamError`` with the worker's reason, or
  ``ResourceExhausted`` where init was refused for capacity (the store could not fit a model:
  the worker's HELLO says ``code: resource_exhausted``): the function is not broken, the node
  is full;
* no reply within ``timeout`` -> ``trims.errors.Timeout`` (the instance stays up);
* the handler raised or returned garbage -> ``UpstreamError`` (or the trims error it raised).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

from trims.errors import (
    ErrorMap,
    NotFound,
    ResourceExhausted,
    Timeout,
    Unavailable,
    UpstreamError,
    ValidationError,
    mapped_errors,
)
from trims.runtime.wire import (
    META_HEADERS,
    META_STATUS,
    META_TRACE,
    Frame,
    Kind,
    decode_arrays,
    encode_arrays,
)
from trims.runtime.worker.client import (
    ConnectionLost,
    WorkerConnection,
    close_quietly,
    raise_for_error,
)
from trims.telemetry import inject_context

if TYPE_CHECKING:
    import numpy as np

    from trims.runtime.functions.spec import FunctionSpec

log = logging.getLogger(__name__)
_NO_HEADERS: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    headers: Mapping[str, str] = field(default_factory=lambda: _NO_HEADERS)
    body: bytes = b""


class Instance(abc.ABC):
    id: str
    function: str
    executor: str
    started_at: float
    #: Why the instance ended ("killed by SIGKILL", "exited with code 1", ...); None while alive.
    exit_reason: str | None = None

    @abc.abstractmethod
    async def wait_ready(self, timeout: float) -> None:
        """Return once init(ctx) has run; UpstreamError with the reason if the instance died."""

    @abc.abstractmethod
    async def invoke(
        self,
        body: bytes,
        headers: Mapping[str, str],
        *,
        timeout: float,
        trace: Mapping[str, str],
    ) -> Reply: ...

    @abc.abstractmethod
    async def infer(
        self, inputs: Mapping[str, np.ndarray], *, timeout: float, trace: Mapping[str, str]
    ) -> dict[str, np.ndarray]: ...

    @abc.abstractmethod
    def alive(self) -> bool: ...

    async def wait_standby(self, timeout: float) -> None:
        """A standby (:meth:`StandbyExecutor.start_standby`): return once it is prepared."""
        raise NotImplementedError(f"{type(self).__name__} has no standby instances")

    async def activate(self, timeout: float) -> None:
        """Run a prepared standby's init; return as :meth:`wait_ready` does."""
        raise NotImplementedError(f"{type(self).__name__} has no standby instances")


class Executor(Protocol):
    name: str

    def check(self, spec: FunctionSpec) -> None:
        """At deploy, before any instance: raise (ValidationError) what would keep ``spec``
        from running here that the executor can tell now (e.g. code its user cannot read)."""
        ...

    async def start(self, spec: FunctionSpec, instance_id: str) -> Instance:
        """Create the instance (process/container exists); the caller then awaits wait_ready."""
        ...

    async def stop(self, instance: Instance, grace_s: float = 10.0) -> None:
        """SIGTERM (the worker drains in-flight requests), SIGKILL after ``grace_s``."""
        ...

    async def close(self) -> None:
        """Stop every instance this executor started and release its resources."""
        ...


@runtime_checkable
class StandbyExecutor(Executor, Protocol):
    """An executor that can also start standby instances (Note [standby instances] in
    :mod:`trims.runtime.gateway.pool`)."""

    async def start_standby(self, spec: FunctionSpec, instance_id: str) -> Instance:
        """Create an instance that prepares (models, code) but runs init only when
        activated; the caller awaits ``wait_standby``, later ``activate``."""
        ...


class WorkerInstance(Instance):
    """An instance reached over the wire protocol; subclasses say where and how it ended.

    The end of life is shared: an executor's watch (a process's exit, a container's or pod's
    end) calls :meth:`_end` with the reason once; :meth:`alive` and :meth:`wait_exit_reason`
    read it. A subclass says where the worker listens (:meth:`address`) and how to stop it
    (:meth:`terminate`).
    """

    #: Seconds between connection attempts while the worker is still binding its socket: the
    #: first retry comes at once (a forked worker binds within milliseconds), later ones back
    #: off to the last value, so a slow start (a container, a pod) is not polled hard.
    CONNECT_RETRY_S = (0.002, 0.25)

    def __init__(self, instance_id: str, function: str, executor: str) -> None:
        self.id = instance_id
        self.function = function
        self.executor = executor
        self.started_at = time.time()
        self.pid: int | None = None
        #: Seconds the worker's init spent acquiring models (from its HELLO; None: no models).
        self.model_acquire_s: float | None = None
        self._conn: WorkerConnection | None = None
        self._ready = False
        self._ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @abc.abstractmethod
    def address(self) -> str:
        """'unix:PATH' or 'tcp:HOST:PORT' of the worker."""

    def _end(self, reason: str) -> None:
        """The worker ended, for ``reason`` (the first reason given is kept)."""
        if self.exit_reason is None:
            self.exit_reason = reason
        if not self._ended.done():
            self._ended.set_result(None)

    def alive(self) -> bool:
        return not self._ended.done()

    async def wait_exit_reason(self, timeout: float) -> str | None:
        """Wait up to ``timeout`` for the worker to end and return why (None if still running)."""
        try:
            await asyncio.wait_for(asyncio.shield(self._ended), timeout)
        except TimeoutError:
            return None
        return self.exit_reason

    @abc.abstractmethod
    async def terminate(self, grace_s: float) -> None:
        """Drain (SIGTERM or the executor's equivalent), kill after ``grace_s``, clean up."""

    def _died(self, reason: str | None) -> UpstreamError:
        return UpstreamError(
            f"instance {self.id} of {self.function} died: {reason or 'connection lost'}",
            instance=self.id,
        )

    async def _death(self) -> UpstreamError:
        reason = self.exit_reason or await self.wait_exit_reason(2.0)
        if reason is not None:
            self.exit_reason = reason
        return self._died(reason)

    async def wait_ready(self, timeout: float) -> None:
        await self._wait_hello(timeout, expect="ready")

    async def wait_standby(self, timeout: float) -> None:
        await self._wait_hello(timeout, expect="standby")

    async def activate(self, timeout: float) -> None:
        if self._conn is None:
            raise RuntimeError(f"instance {self.id}: activate before wait_standby")
        try:
            # The caller's current span (the pool's "instance start") parents the worker's init.
            self._conn.activate(inject_context())
        except ConnectionLost:
            raise await self._death() from None
        await self._wait_hello(timeout, expect="ready", past="standby")

    async def _connect(self, deadline: float, timeout: float) -> WorkerConnection:
        retry_s, most_s = self.CONNECT_RETRY_S
        while self._conn is None:
            if self.exit_reason is not None or not self.alive():
                raise await self._death()
            left = deadline - time.monotonic()
            try:
                # Each attempt is bounded by the deadline: a TCP address that drops packets
                # (a pod IP gone from the network) would otherwise hold the connect for the
                # kernel's SYN timeout, well past the caller's timeout.
                self._conn = await asyncio.wait_for(
                    WorkerConnection.open(self.address()), max(0.001, left)
                )
            except (OSError, TimeoutError):
                if time.monotonic() >= deadline:
                    raise Timeout(
                        f"instance {self.id} of {self.function} did not open "
                        f"{self.address()} within {timeout:.1f} s"
                    ) from None
                await asyncio.sleep(min(retry_s, max(0.0, deadline - time.monotonic())))
                retry_s = min(retry_s * 2, most_s)
        return self._conn

    async def _wait_hello(self, timeout: float, *, expect: str, past: str | None = None) -> None:
        """Connect, then wait for a HELLO whose state is not ``past``; one that is not
        ``expect`` ("ready" or "standby") raises with the worker's reason."""
        deadline = time.monotonic() + timeout
        conn = await self._connect(deadline, timeout)
        try:
            hello = await asyncio.wait_for(
                conn.hello(past), max(0.001, deadline - time.monotonic())
            )
        except TimeoutError:
            raise Timeout(
                f"instance {self.id} of {self.function} did not finish init within {timeout:.1f} s"
            ) from None
        except ConnectionLost:
            raise await self._death() from None
        state = hello.get("state")
        if state != expect:
            reason = str(hello.get("reason", f"it said {state!r}"))
            self.exit_reason = f"init failed: {reason}"
            await close_quietly(self._conn)
            message = f"instance {self.id} of {self.function} failed to start: {reason}"
            if hello.get("code") == ResourceExhausted.code:
                raise ResourceExhausted(message, instance=self.id)
            raise UpstreamError(message)
        self.pid = hello.get("pid", self.pid)
        if expect == "standby":
            return
        acquire_s = hello.get("model_acquire_s")
        self.model_acquire_s = float(acquire_s) if isinstance(acquire_s, int | float) else None
        self._ready = True

    async def _request(
        self, kind: Kind, meta: Mapping[str, Any] | None, body: bytes, timeout: float
    ) -> Frame:
        conn = self._conn
        if self.exit_reason is not None:
            raise self._died(self.exit_reason)
        if conn is None or not self._ready:
            raise Unavailable(f"instance {self.id} of {self.function} is not ready")
        try:
            frame = await conn.request(kind, meta, body, timeout)
        except TimeoutError:
            raise Timeout(
                f"function {self.function} did not answer within {timeout:.1f} s "
                f"(instance {self.id})"
            ) from None
        except ConnectionLost:
            raise await self._death() from None
        raise_for_error(frame)
        return frame

    async def invoke(
        self,
        body: bytes,
        headers: Mapping[str, str],
        *,
        timeout: float,
        trace: Mapping[str, str],
    ) -> Reply:
        meta: dict[str, Any] | None = None
        if headers or trace:
            meta = {}
            if headers:
                meta[META_HEADERS] = dict(headers)
            if trace:
                meta[META_TRACE] = dict(trace)
        frame = await self._request(Kind.INVOKE, meta, body, timeout)
        m = frame.meta
        if not m:
            return Reply(200, _NO_HEADERS, frame.body)
        return Reply(int(m.get(META_STATUS, 200)), m.get(META_HEADERS) or _NO_HEADERS, frame.body)

    async def infer(
        self, inputs: Mapping[str, np.ndarray], *, timeout: float, trace: Mapping[str, str]
    ) -> dict[str, np.ndarray]:
        meta = {META_TRACE: dict(trace)} if trace else None
        frame = await self._request(Kind.INFER, meta, encode_arrays(inputs), timeout)
        return decode_arrays(frame.body)

    async def request(
        self, kind: Kind, meta: Mapping[str, Any] | None, body: bytes, *, timeout: float
    ) -> Frame:
        """One round trip with the reply frame as is (meta included): for callers that need
        more of the reply than :meth:`invoke` and :meth:`infer` give (a traced request's spans
        ride in its reply meta). Errors as in the module docstring."""
        return await self._request(kind, meta, body, timeout)

    async def close_connection(self) -> None:
        conn, self._conn = self._conn, None
        self._ready = False
        await close_quietly(conn)


W = TypeVar("W", bound=WorkerInstance)


class ExecutorBase(Generic[W]):
    """The part of an executor that is the same everywhere: the table of the instances it
    started, refusing work once closed, stopping one and closing all (in the shape of aiohttp's
    ``BaseRunner``: the skeleton here, the specifics in hooks).

    A subclass sets :attr:`name`, starts its instance in ``start`` between
    :meth:`_check_start` and :meth:`_track`, and releases its own resources (a client, a zygote,
    a state folder) in :meth:`_release`; :meth:`_stop_failed` may clean up after an instance
    that could not be stopped.
    """

    name: str

    def __init__(self) -> None:
        self._instances: dict[str, W] = {}
        self._closed = False

    @property
    def instances(self) -> Sequence[Instance]:
        return tuple(self._instances.values())

    def _check_start(self, instance_id: str) -> None:
        """ValidationError when closed or ``instance_id`` is taken (before anything starts)."""
        if self._closed:
            raise ValidationError(f"{self.name} executor is closed; create a new one")
        if instance_id in self._instances:
            raise ValidationError(f"instance id {instance_id!r} is already in use")

    def _track(self, instance: W) -> W:
        self._instances[instance.id] = instance
        return instance

    async def stop(self, instance: Instance, grace_s: float = 10.0) -> None:
        """SIGTERM (the worker drains), SIGKILL after ``grace_s``, then clean up after it."""
        await pop_managed(self._instances, instance, self.name).terminate(grace_s)

    async def close(self) -> None:
        """Stop every instance (5 s to drain), then release the executor's own resources."""
        self._closed = True
        instances, self._instances = list(self._instances.values()), {}
        for instance, error in await terminate_all(instances, 5.0):
            await self._stop_failed(instance, error)
        await self._release()

    async def _stop_failed(self, instance: W, error: BaseException) -> None:
        log.warning("instance %s of %s could not be stopped: %s",
                    instance.id, instance.function, error)  # fmt: skip

    async def _release(self) -> None:
        """Release what the executor holds besides its instances (nothing by default)."""


def pop_managed(instances: dict[str, W], instance: Instance, executor: str) -> W:
    """Take ``instance`` out of an executor's table, or NotFound naming the executor."""
    managed = instances.pop(instance.id, None)
    if managed is None:
        raise NotFound(f"instance {instance.id} is not managed by this {executor} executor")
    return managed


async def terminate_all(instances: Sequence[W], grace_s: float) -> list[tuple[W, BaseException]]:
    """Terminate ``instances`` concurrently; the (instance, error) pairs of those that failed."""
    results = await asyncio.gather(
        *(i.terminate(grace_s) for i in instances), return_exceptions=True
    )
    return [(i, r) for i, r in zip(instances, results, strict=True) if isinstance(r, BaseException)]


def refuse_environment(spec: FunctionSpec, executor: str) -> None:
    """At deploy on a container executor: a spec's ``environment`` names an interpreter on the
    gateway's host, which a container does not have; its image is its environment."""
    if spec.environment is not None:
        raise ValidationError(
            f"environment {spec.environment!r} names an interpreter on the gateway's host, which "
            f"the {executor} executor's containers do not have: give the function an image "
            "that holds what it needs instead (for MXNet: trims-runtime:mxnet, built by "
            "'bash dockerfiles/build-image.sh mxnet'), or deploy it with the local executor",
            field="environment",
        )


#: Note [worker environment]: the variables of the executor's own environment a worker may
#: inherit (an entry ending in ``_`` is a prefix); everything else it gets is written down: the
#: executor's settings ``env``, the spec's ``env``, and what the executor sets itself
#: (``TRIMS_SOCKET``, ``TRIMS_OTLP_ENDPOINT``, the trace context). A gateway's environment
#: holds its secrets (``TRIMS_GATEWAY_TOKENS``, ``TRIMS_TOKEN``, cloud credentials, an OTLP
#: collector's headers), and function code can read its own environment: a worker inherited
#: the gateway's whole environment until its admin token was read back by a function. Why each
#: entry is here:
#:
#: * ``PATH``, ``HOME``, ``LANG``, ``LANGUAGE``, ``LC_*``, ``TZ``, ``TMPDIR``: what any program
#:   expects to find (executables, caches, locale, time zone, the temp dir);
#: * ``OMP_*``, ``GOMP_*``, ``KMP_*``, ``MKL_*``, ``OPENBLAS_*``: the frameworks' thread pools
#:   (Note [passive OpenMP threads] in :mod:`trims.runtime.functions.spec`: ``GOMP_SPINCOUNT``
#:   in the gateway's environment is how a node tunes them);
#: * ``CUDA_*``, ``NVIDIA_*``, ``LD_LIBRARY_PATH``: which devices the node gives the gateway,
#:   and where the CUDA libraries are;
#: * ``PYTHONPATH``, ``PYTHONUNBUFFERED``, ``PYTHONDONTWRITEBYTECODE``: where the interpreter
#:   finds trims in a development checkout, and how it writes;
#: * ``TRIMS_SOCKET``, ``TRIMS_LOG_LEVEL``, ``TRIMS_DEBUG``: the worker's own settings (the
#:   store socket it connects to, its log level, full tracebacks);
#: * ``COVERAGE_*``: coverage.py's measurement of the processes a test suite starts.
#:
#: Never ``TRIMS_GATEWAY_TOKENS``, ``TRIMS_TOKEN`` or any other ``TRIMS_*``, nor ``OTEL_*``
#: (exporter headers carry credentials: the executor passes the resolved endpoint alone).
WORKER_ENV_ALLOWED: tuple[str, ...] = (
    "PATH", "HOME", "LANG", "LANGUAGE", "LC_", "TZ", "TMPDIR",
    "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_",
    "CUDA_", "NVIDIA_", "LD_LIBRARY_PATH",
    "PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE",
    "TRIMS_SOCKET", "TRIMS_LOG_LEVEL", "TRIMS_DEBUG",
    "COVERAGE_",
)  # fmt: skip


def inherited_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of ``environ`` a worker may inherit (Note [worker environment])."""
    names = frozenset(e for e in WORKER_ENV_ALLOWED if not e.endswith("_"))
    prefixes = tuple(e for e in WORKER_ENV_ALLOWED if e.endswith("_"))
    return {k: v for k, v in environ.items() if k in names or k.startswith(prefixes)}


R = TypeVar("R")


async def call_in_thread(
    action: str,
    table: Sequence[ErrorMap],
    fn: Callable[..., R],
    *args: Any,
    detail: Callable[[Any], str] = str,
    **kwargs: Any,
) -> R:
    """Run a blocking client call (docker, kubernetes) in a thread, its errors translated by
    the library's ``table`` (:func:`trims.errors.mapped_errors`)."""
    with mapped_errors(action, table, detail):
        return await asyncio.to_thread(fn, *args, **kwargs)
