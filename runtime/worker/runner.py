"""Run one function instance: acquire its models, import its code, init, serve, drain.

The whole life of a worker process is :func:`run_worker`; the CLI (``trims worker``) and the
zygote's fork child both call it with a :class:`WorkerSettings`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from opentelemetry import trace

from trims.config import admin_socket_for, default_socket, format_size
from trims.errors import TrimsError, UpstreamError, ValidationError
from trims.runtime.functions.context import Context, Request
from trims.runtime.functions.errors import ClientError
from trims.runtime.functions.spec import FunctionSpec
from trims.runtime.wire import (
    META_HEADERS,
    META_STATUS,
    META_TRACE,
    TRACE_LEVEL,
    TRACE_REPLY,
    Frame,
    Kind,
    decode_arrays,
    encode_arrays,
)
from trims.runtime.worker.access import User, check_code
from trims.runtime.worker.exits import EXIT_INIT_FAILED, EXIT_OUT_OF_MEMORY
from trims.runtime.worker.imports import TRACING_MODULES, WORKER_MODULES, preimport
from trims.runtime.worker.loader import FunctionCode, load_code
from trims.runtime.worker.model_set import ModelSet, acquire_models, connect_store
from trims.runtime.worker.results import check_outputs, to_reply
from trims.runtime.worker.sandbox import (
    Confinement,
    apply_memory_limit,
    close_inherited_fds,
    confine,
    end_children,
    verify_unprivileged,
)
from trims.runtime.worker.server import ListenAddress, WorkerServer
from trims.runtime.worker.team import make_team, uses_torch
from trims.runtime.worker.tracing import RequestTrace

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("trims.worker")
#: Seconds a worker whose init failed waits for a client to collect the reason before exiting.
FAILED_LINGER_S = 10.0


@dataclass(frozen=True)
class WorkerSettings:
    spec: FunctionSpec
    listen: ListenAddress
    instance_id: str
    #: Store socket for model acquisition; None -> trims.config.default_socket(environ).
    store_socket: Path | None = None
    confinement: Confinement = field(default_factory=Confinement)
    otlp_endpoint: str | None = None
    #: W3C trace context of whoever started the instance: init and model spans join its trace.
    start_trace: Mapping[str, str] = field(default_factory=dict)
    #: Start as a standby: prepare (models mapped and populated, code imported), say so, and
    #: run init only on a client's ACTIVATE (Note [standby instances] in
    #: trims.runtime.gateway.pool).
    standby: bool = False


class StartPhases:
    """When each step of this worker's start ended (``CLOCK_MONOTONIC``, which every process on
    the machine shares, so a caller can line them up with its own clock); logged at debug
    level once the instance is ready, as the breakdown of an instance start."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        self.marks.append((phase, time.monotonic()))

    def line(self) -> str:
        """``phase=+ms`` since the first mark, then that mark's monotonic time."""
        if not self.marks:
            return "no phases"
        first = self.marks[0][1]
        steps = ", ".join(f"{name} +{(t - first) * 1e3:.1f}" for name, t in self.marks)
        return f"{steps} ms (from monotonic {first:.6f})"


#: This process's start (one worker per process).
PHASES = StartPhases()


@dataclass(frozen=True)
class Prestarted:
    """A pooled worker's state before it knew its function (Note [warm pool] in
    :mod:`trims.runtime.executors.zygote`): already confined but for the memory limit."""

    #: The ``run_as`` it was confined for; a request asking for another user is refused.
    run_as: str | None
    #: The user it dropped to (None: it runs as its own user).
    dropped_to: str | None
    #: The event loop it made and ran once ahead (Note [start rehearsal] in
    #: trims.runtime.executors.zygote; None: one is made at start).
    loop: asyncio.AbstractEventLoop | None = None
    #: A connection to the store the zygote made for it when it handed over the request (it
    #: dropped privileges, and the store socket may be closed to its user); None: it
    #: connects itself.
    store_connection: socket.socket | None = None


def _bind_prestarted(settings: WorkerSettings, pre: Prestarted) -> Any:
    """Finish a pooled worker's confinement for ``settings``; the store client to use."""
    c = settings.confinement
    if c.run_as != pre.run_as:
        raise TrimsError(
            f"pooled worker confined for user {pre.run_as!r} was handed an instance for "
            f"{c.run_as!r}; restart the gateway (its warm pool and its --run-as disagree)"
        )
    if c.memory_bytes is not None:
        apply_memory_limit(c.memory_bytes, c.threads)
    handed = pre.store_connection
    if not settings.spec.models:
        if handed is not None:
            handed.close()
        return None
    return connect_store(settings.store_socket, handed)


class Worker:
    def __init__(
        self, settings: WorkerSettings, store: Any = None, dropped_to: str | None = None
    ) -> None:
        """``store``: a StoreClient connected before privileges were dropped (or None);
        ``dropped_to``: the user the process dropped to (None: it runs as its own user)."""
        self.settings = settings
        self._store = store
        self._dropped_to = dropped_to
        self.spec = settings.spec
        self._pool = ThreadPoolExecutor(
            max_workers=self.spec.scaling.concurrency, thread_name_prefix=f"fn-{self.spec.name}"
        )
        self._code: FunctionCode | None = None
        self._ctx: Context | None = None
        self._models = ModelSet()
        #: Seconds init spent acquiring the function's models (None: it has none).
        self.model_acquire_s: float | None = None
        self.out_of_memory = asyncio.Event()
        self.server = WorkerServer(
            settings.listen,
            self._run_frame,
            {"pid": os.getpid(), "function": self.spec.name, "instance": settings.instance_id},
        )

    def _check_confinement(self) -> None:
        """Before any function code: prove the drop held, and that the code is readable."""
        user = self._dropped_to
        if user is not None:
            store = self.settings.store_socket or default_socket(dict(os.environ))
            verify_unprivileged(admin_socket_for(store))
        check_code(self.spec, User(os.getuid(), os.getgid()).label)

    async def initialize(self) -> None:
        """Acquire models, import code, run init(ctx). Raises with the reason on failure."""
        t0 = time.perf_counter()
        with self._span("worker.init"):
            await self._prepare()
            await self._init()
            await self._make_team()
        self._log_ready(t0)

    async def prepare_standby(self) -> None:
        """A standby's first half: what :meth:`initialize` does before init(ctx), and the
        models' page tables filled, so the first request after :meth:`activate` is warm."""
        t0 = time.perf_counter()
        with self._span("worker.prepare"):
            await self._prepare()
            await self._call(self._models.populate, False)
            PHASES.mark("populated")
        log.info("instance %s of %s prepared as a standby in %.1f ms", self.settings.instance_id,
                 self.spec.name, (time.perf_counter() - t0) * 1e3)  # fmt: skip

    async def activate(self, trace: Mapping[str, str]) -> None:
        """A standby's second half: init(ctx), in the trace of whoever activated it."""
        PHASES.mark("activated")
        t0 = time.perf_counter()
        with self._span("worker.init", trace):
            await self._init()
        self._log_ready(t0)

    def _span(self, name: str, trace: Mapping[str, str] | None = None) -> Any:
        carrier = self.settings.start_trace if trace is None else trace
        parent = _extract(carrier) if carrier else None
        return _tracer.start_as_current_span(
            name, context=parent, attributes={"function": self.spec.name}
        )

    def _log_ready(self, t0: float) -> None:
        log.debug("instance %s start phases: %s", self.settings.instance_id, PHASES.line())
        log.info(
            "instance %s of %s ready in %.1f ms",
            self.settings.instance_id, self.spec.name, (time.perf_counter() - t0) * 1e3,
        )  # fmt: skip

    async def _prepare(self) -> None:
        """Check the confinement, acquire the models, import the code."""
        self._check_confinement()
        PHASES.mark("checked")
        t_models = time.perf_counter()
        self._models = await self._call(acquire_models, False, self.spec, self._store)
        if self.spec.models:
            self.model_acquire_s = time.perf_counter() - t_models
            PHASES.mark("models")
        # Note [imports on the loop thread]: the function's module is imported on the
        # event loop's thread (which has nothing else to do before the instance is ready),
        # not in the pool. ``load_code`` puts the code_dir on sys.path, and a tracer that
        # watches sys.path may react from another thread: coverage.py (CI measures coverage
        # in workers) re-reads its path matchers on the next file any thread meets after
        # sys.path changed, snapshotting sys.modules and deleting every module that
        # appeared while it imported its source packages. Imported in the pool, the handler
        # module could appear in that window while the loop's thread ran the re-read, and
        # its own import then failed with ``KeyError: 'gwfuncs' (at <frozen
        # importlib._bootstrap>:701 in _load_unlocked)`` (seen in two CI runs of about
        # ten). On one thread the re-read happens inside the import, before the module has
        # a chance to be counted as new.
        self._code = load_code(self.spec)
        PHASES.mark("imported")

    async def _init(self) -> None:
        """Build the context and run the function's init(ctx)."""
        code = self._code
        assert code is not None
        self._ctx = Context(
            function=self.spec.name,
            instance_id=self.settings.instance_id,
            models=MappingProxyType(self._models.models),
            logger=logging.getLogger(f"trims.function.{self.spec.name}"),
            tracer=trace.get_tracer(f"trims.function.{self.spec.name}"),
            config=self.spec.config,
        )
        if code.init is not None:
            await self._call(code.init, asyncio.iscoroutinefunction(code.init), self._ctx)
            PHASES.mark("init")

    async def _make_team(self) -> None:
        """torch's thread team on the thread that will run the function's calls, when its code
        imports torch (Note [team before the first request] in
        :mod:`trims.runtime.worker.team`): queued without waiting at a concurrency of 1."""
        code = self._code
        assert code is not None
        if "torch" not in sys.modules or not uses_torch(code.handler, code.infer, code.init):
            return
        if self.spec.scaling.concurrency > 1:
            await self._call(_make_team_quietly, False)
            PHASES.mark("team")
        else:
            self._pool.submit(_make_team_quietly)

    async def _call(self, fn: Any, is_async: bool, *args: Any) -> Any:
        if is_async:
            return await fn(*args)
        run = contextvars.copy_context().run
        return await asyncio.get_running_loop().run_in_executor(self._pool, run, fn, *args)

    async def _run_frame(self, frame: Frame) -> tuple[dict[str, Any], bytes]:
        """One request, in a server span joined to the caller's trace.

        Without a caller trace and without an exporter the span would record nothing, so the
        hot path skips it (it costs about as much as the rest of the worker's request work).
        """
        level = frame.meta.get(TRACE_LEVEL)
        if level is not None:
            return await self._run_traced(frame, str(level))
        carrier = frame.meta.get(META_TRACE)
        if not carrier and not self.settings.otlp_endpoint:
            return await self._dispatch(frame, None)
        parent = _extract(carrier) if carrier else None
        name = f"{'infer' if frame.kind is Kind.INFER else 'handler'} {self.spec.name}"
        with _tracer.start_as_current_span(
            name, context=parent, kind=trace.SpanKind.SERVER
        ) as span:
            return await self._dispatch(frame, span)

    async def _run_traced(self, frame: Frame, level: str) -> tuple[dict[str, Any], bytes]:
        """A request that asked for a trace: its spans ride back in the reply meta (see
        :mod:`trims.runtime.worker.tracing`); kept apart so untraced requests pay nothing."""
        recorder = RequestTrace(level, self.spec.name, self.settings.instance_id)
        carrier = frame.meta.get(META_TRACE)
        if carrier or self.settings.otlp_endpoint:
            name = f"{'infer' if frame.kind is Kind.INFER else 'handler'} {self.spec.name}"
            with _tracer.start_as_current_span(
                name, context=_extract(carrier) if carrier else None, kind=trace.SpanKind.SERVER
            ) as span:
                meta, body = await self._dispatch(frame, span, recorder)
        else:
            meta, body = await self._dispatch(frame, None, recorder)
        return {**meta, TRACE_REPLY: recorder.finish()}, body

    async def _dispatch(
        self, frame: Frame, span: trace.Span | None, recorder: RequestTrace | None = None
    ) -> tuple[dict[str, Any], bytes]:
        code, ctx = self._code, self._ctx
        assert code is not None and ctx is not None
        name = "infer" if frame.kind is Kind.INFER else "handler"
        try:
            if frame.kind is Kind.INFER:
                if code.infer is None:
                    raise ValidationError(
                        f"function {self.spec.name} serves no model: its module defines "
                        "no infer(inputs, ctx)"
                    )
                inputs = decode_arrays(frame.body)
                infer = code.infer
                if recorder is not None:
                    infer = recorder.wrap(infer, code.infer_is_async, f"infer {self.spec.name}")
                result = await self._call(infer, code.infer_is_async, inputs, ctx)
                return {}, encode_arrays(check_outputs(self.spec.name, result))
            raw = frame.meta.get(META_HEADERS)
            headers = {k.lower(): v for k, v in raw.items()} if raw else {}
            request = Request(frame.body, MappingProxyType(headers))
            handler = code.handler
            if recorder is not None:
                handler = recorder.wrap(handler, code.handler_is_async, f"handler {self.spec.name}")
            result = await self._call(handler, code.handler_is_async, request, ctx)
            status, reply_headers, body = to_reply(self.spec.name, result)
            meta = (
                {META_STATUS: status, META_HEADERS: reply_headers}
                if reply_headers or status != 200
                else {}
            )
            return meta, body
        except (MemoryError, RuntimeError) as e:
            if not _out_of_memory(e):
                raise self._failed(name, e, span) from e
            self.out_of_memory.set()
            if span is not None:
                span.record_exception(e)
            limit = self.spec.resources.memory_bytes
            raise UpstreamError(
                f"{name} of {self.spec.name} ran out of memory"
                + (f" (limit {format_size(limit)})" if limit else "")
                + "; the instance is replaced"
            ) from e
        except (TrimsError, asyncio.CancelledError):
            raise
        except ClientError as e:
            # The caller's mistake, said by the handler: its status, not 502 (see errors.py).
            raise e.to_error() from e
        except Exception as e:
            raise self._failed(name, e, span) from e

    def _failed(self, name: str, e: Exception, span: trace.Span | None) -> UpstreamError:
        if span is not None:
            span.record_exception(e)
        log.exception("%s of %s raised", name, self.spec.name)
        return UpstreamError(f"{name} of {self.spec.name} raised {type(e).__name__}: {e}")

    def close(self) -> None:
        self._models.release_all()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _make_team_quietly() -> None:
    """:func:`make_team`, which is an optimisation: a failure is logged, never raised."""
    try:
        make_team()
    except Exception as e:
        log.debug("torch's thread team not made ahead (%s); the first request makes it", e)


def _out_of_memory(e: BaseException) -> bool:
    """MemoryError, or a framework's allocator failing (torch: "can't allocate memory")."""
    if isinstance(e, MemoryError):
        return True
    text = str(e)
    return "can't allocate memory" in text or "std::bad_alloc" in text


def failure_reason(e: BaseException) -> str:
    """Why init failed, for the caller: a TrimsError's message, or an unexpected exception with
    the place it was raised (``KeyError: 'x' (at loader.py:39 in load_code)``), since the
    worker's log, with the whole traceback, goes away with the instance."""
    if isinstance(e, TrimsError):
        return e.message
    frames = traceback.extract_tb(e.__traceback__)
    where = ""
    if frames:
        last = frames[-1]
        where = f" (at {os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    return f"{type(e).__name__}: {e}{where}"


def _extract(carrier: Mapping[str, str]) -> Any:
    from trims.telemetry import extract_context

    return extract_context(dict(carrier))


async def _serve(settings: WorkerSettings, store: Any, dropped_to: str | None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    worker = Worker(settings, store, dropped_to)
    await worker.server.start()
    PHASES.mark("listening")
    try:
        try:
            if settings.standby:
                await worker.prepare_standby()
                worker.server.set_standby()
                if not await _activated(worker.server.activated, stop):
                    return 0  # stopped while a standby: nothing ran init, nothing to drain
                await worker.activate(worker.server.activate_trace)
            else:
                await worker.initialize()
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            reason = failure_reason(e)
            log.error("instance %s of %s failed to start: %s",
                      settings.instance_id, settings.spec.name, reason,
                      exc_info=not isinstance(e, TrimsError))  # fmt: skip
            print(f"init failed: {reason}", file=sys.stderr, flush=True)
            worker.server.set_failed(reason, e.code if isinstance(e, TrimsError) else None)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.server.failure_delivered.wait(), FAILED_LINGER_S)
            await asyncio.sleep(0.05)
            return EXIT_INIT_FAILED
        worker.server.set_ready(model_acquire_s=worker.model_acquire_s)
        oom = loop.create_task(worker.out_of_memory.wait(), name="worker-oom-watch")
        stopping = loop.create_task(stop.wait(), name="worker-stop-watch")
        await asyncio.wait({oom, stopping}, return_when=asyncio.FIRST_COMPLETED)
        oom.cancel()
        stopping.cancel()
        if worker.out_of_memory.is_set():
            await asyncio.sleep(0.05)
            print("out of memory: a request hit the memory limit", file=sys.stderr, flush=True)
            return EXIT_OUT_OF_MEMORY
        await worker.server.drain()
        return 0
    finally:
        await worker.server.close()
        worker.close()


async def _activated(activated: asyncio.Event, stop: asyncio.Event) -> bool:
    """Wait for a client's ACTIVATE (True) or a stop signal (False)."""
    loop = asyncio.get_running_loop()
    waits = {loop.create_task(activated.wait()), loop.create_task(stop.wait())}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
    return activated.is_set() and not stop.is_set()


def size_thread_pools(cpus: float | None) -> None:
    """Cap the frameworks' thread pools at ``ceil(cpus)`` (a soft CPU limit, not a quota).

    Environment variables reach libraries loaded from now on; torch, already imported in a
    zygote child but not yet used, is told directly (safe: its pool does not exist yet).
    """
    if cpus is None:
        return
    n = str(max(1, math.ceil(cpus)))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(name, n)
    torch = sys.modules.get("torch")
    if torch is not None:
        threads = os.environ["OMP_NUM_THREADS"]
        torch.set_num_threads(int(threads) if threads.isdigit() else int(n))


def _loop_factory(prestarted: Prestarted | None) -> Callable[[], asyncio.AbstractEventLoop]:
    """The pooled worker's event loop made ahead, else a new uvloop loop."""
    import uvloop

    loop = prestarted.loop if prestarted is not None else None
    if loop is None:
        return uvloop.new_event_loop

    def made_ahead() -> asyncio.AbstractEventLoop:
        return loop

    return made_ahead


def run_worker(settings: WorkerSettings, prestarted: Prestarted | None = None) -> int:
    """The worker process's main: set up telemetry, confine, serve until SIGTERM.

    ``prestarted``: this is a pooled worker, confined before it knew ``settings`` (only the
    memory limit and, without a drop, the store connection are left to do)."""
    from trims.telemetry import setup_logging, setup_tracing

    # Everything the worker imports, imported while it may still read the project's files
    # (a no-op in a zygote child, which inherited them): see trims.runtime.worker.imports.
    # Telemetry is set up before the drop too: the exporter imports its transport lazily.
    PHASES.mark("main")
    preimport(WORKER_MODULES + (TRACING_MODULES if settings.otlp_endpoint else ()))
    if prestarted is None:
        # A pooled worker did this before it made its loop (Note [what a worker inherits]).
        close_inherited_fds()
    setup_logging(os.environ.get("TRIMS_LOG_LEVEL", "INFO"))
    if settings.otlp_endpoint:
        setup_tracing(f"trims-worker-{settings.spec.name}", settings.otlp_endpoint)
    PHASES.mark("telemetry")
    store: list[Any] = []
    if prestarted is not None:
        client = _bind_prestarted(settings, prestarted)
        store = [client] if client is not None else []
        dropped_to = prestarted.dropped_to
    elif settings.spec.models:
        dropped_to = confine(
            settings.confinement, lambda: store.append(connect_store(settings.store_socket))
        )
    else:
        dropped_to = confine(settings.confinement)
    size_thread_pools(settings.spec.resources.cpus)
    PHASES.mark("confined")
    try:
        with asyncio.Runner(loop_factory=_loop_factory(prestarted)) as runner:
            return runner.run(_serve(settings, store[0] if store else None, dropped_to))
    finally:
        end_children()  # Note [an instance's processes end with it]
        # The caller leaves with os._exit (a hung handler thread must not block the exit), so
        # batched spans would be lost without this flush.
        flush = getattr(trace.get_tracer_provider(), "force_flush", None)
        if flush is not None:
            flush(5000)
