"""The gateway's state: deployed functions (each with its pool), pipelines, async invocations.

HTTP handlers call this; it knows nothing about HTTP. Specs are kept in ``state_dir`` (when
set) so a restarted gateway, even one killed with SIGKILL, comes back with the same functions
and pipelines; instances are not persisted, they start again on demand.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from opentelemetry import trace

from trims.config import write_atomic
from trims.errors import AlreadyExists, NotFound, TrimsError, Unavailable, ValidationError
from trims.runtime.executors.base import Executor, StandbyExecutor
from trims.runtime.functions.spec import FunctionSpec, parse_spec
from trims.runtime.gateway.budget import node_budget
from trims.runtime.gateway.code_rules import check_code
from trims.runtime.gateway.invocations import Invocations, Outcome
from trims.runtime.gateway.metrics import GatewayMetrics
from trims.runtime.gateway.model_check import check_models
from trims.runtime.gateway.pipelines import PipelineSpec, parse_pipeline, run_pipeline
from trims.runtime.gateway.pool import Pool
from trims.runtime.gateway.traced import TracedCall, TraceExporter, TraceStore, response_headers
from trims.runtime.settings import GatewaySettings
from trims.telemetry import inject_context

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

#: Executors on which a spec's code_dir is a path inside the image, not on this host; every
#: other executor (local; docker bind-mounts it) gets the host checks of code_rules.
IMAGE_CODE_EXECUTORS = frozenset({"kubernetes"})

#: executor name -> a started executor (the gateway owns and closes it).
ExecutorFactory = Callable[[str], Executor]

#: Request headers never passed to a function: the caller's credentials and hop-by-hop headers.
DROPPED_HEADERS = frozenset(
    {"authorization", "connection", "keep-alive", "transfer-encoding", "upgrade", "host",
     "content-length", "te", "trailer", "proxy-authorization", "expect"}
)  # fmt: skip


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The request headers a function gets: names lower-cased, :data:`DROPPED_HEADERS` left out."""
    return {low: v for k, v in headers.items() if (low := k.lower()) not in DROPPED_HEADERS}


class Gateway:
    def __init__(self, settings: GatewaySettings, executor_factory: ExecutorFactory) -> None:
        self.settings = settings
        self._executor_factory = executor_factory
        self._executors: dict[str, Executor] = {}
        self.pools: dict[str, Pool] = {}
        self.pipelines: dict[str, PipelineSpec] = {}
        self.budget = node_budget(settings)
        self.metrics = GatewayMetrics(
            self._instance_counts, self._pending_counts, self.budget.memory_state
        )
        self.invocations = Invocations(
            ttl_s=settings.invocation_ttl_s, capacity=settings.max_invocations
        )
        #: Whether spans are recorded (an SDK tracer provider is installed); when not, the hot
        #: path creates no spans and passes the caller's own trace context on to the worker.
        self.tracing = tracing_enabled()
        #: Traces of invocations that asked for one (``trims-trace-level``).
        self.traces = TraceStore(count=settings.traces_kept, max_bytes=settings.traces_kept_bytes)
        self.trace_exporter = TraceExporter(settings.otlp_endpoint)
        self.draining = False
        self._closed = False
        self._closing: set[asyncio.Task[None]] = set()

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Prepare the default executor, restore the functions and pipelines in ``state_dir``."""
        # Its first call imports the propagators (about 2 ms): paid here, not by the first
        # cold start (an executor passes the start's trace context to the instance).
        inject_context()
        if self.settings.warm_executor:
            prepare = getattr(self._executor(self.settings.executor), "prepare", None)
            if prepare is not None:
                await prepare()
        state = self.settings.state_dir
        if state is None:
            return
        for path in sorted((state / "functions").glob("*.json")):
            try:
                await self.deploy(parse_spec(json.loads(path.read_text())), replace=True)
            except (ValueError, TrimsError) as e:
                log.error("saved function %s not restored: %s; deploy it again", path.stem, e)
        for path in sorted((state / "pipelines").glob("*.json")):
            try:
                self.put_pipeline(parse_pipeline(json.loads(path.read_text())))
            except (ValueError, TrimsError) as e:
                log.error("saved pipeline %s not restored: %s; create it again", path.stem, e)

    async def close(self, drain_timeout_s: float) -> None:
        """Refuse new work, let in-flight requests finish, stop every instance and executor."""
        if self._closed:
            return
        self._closed = True
        self.draining = True
        started = time.monotonic()
        await self.invocations.close(drain_timeout_s)
        left = max(0.0, drain_timeout_s - (time.monotonic() - started))
        pools = list(self.pools.values())
        await asyncio.gather(*(p.close(left) for p in pools), return_exceptions=True)
        self.pools.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)
        await self.trace_exporter.close(max(0.0, drain_timeout_s - (time.monotonic() - started)))
        for name, executor in self._executors.items():
            try:
                await executor.close()
            except Exception:
                log.exception("closing executor %s failed", name)
        self._executors.clear()

    def _executor(self, name: str) -> Executor:
        executor = self._executors.get(name)
        if executor is None:
            executor = self._executor_factory(name)
            self._executors[name] = executor
        return executor

    # -- functions -----------------------------------------------------------------------------

    async def deploy(self, spec: FunctionSpec, *, replace: bool) -> bool:
        """Deploy (or with ``replace`` update) a function; True when it is new."""
        self._refuse_when_draining()
        limit = self.settings.instance_limit
        if spec.scaling.max_instances > limit:  # min_instances <= max_instances already
            raise ValidationError(
                f"scaling.max_instances: {spec.scaling.max_instances} is more than this gateway "
                f"allows per function; use at most {limit}",
                field="scaling.max_instances",
            )
        old = self.pools.get(spec.name)
        if old is not None and not replace:
            raise AlreadyExists(
                f"function {spec.name} exists; PUT /v1/functions/{spec.name} updates it"
            )
        executor_name = spec.executor or self.settings.executor
        executor = self._executor(executor_name)
        if spec.scaling.standby and not isinstance(executor, StandbyExecutor):
            raise ValidationError(
                f"scaling.standby: the {executor_name} executor keeps no standby instances "
                "(the local and docker executors do); set it to 0 or deploy with one of those",
                field="scaling.standby",
            )
        check_code(
            spec,
            protected=self._protected_dirs(),
            roots=self.settings.code_roots,
            on_host=executor_name not in IMAGE_CODE_EXECUTORS,
        )
        # Off the event loop, in one hop: the executor's check may fork (the local executor
        # reads the code as its workers' user) or ask the Docker Engine for an image's label,
        # and the models' check may ask the store.
        on_host = executor_name not in IMAGE_CODE_EXECUTORS
        await asyncio.to_thread(_check_deploy, executor, spec, on_host, self.settings.store_socket)
        pool = Pool(spec, executor, self.metrics, budget=self.budget)
        self.pools[spec.name] = pool
        pool.start()
        self._save("functions", spec.name, spec.to_dict())
        if old is not None:
            self._close_later(old)
            log.info("function %s updated; old instances drain", spec.name)
        else:
            log.info("function %s deployed", spec.name)
        return old is None

    def _protected_dirs(self) -> list[Path]:
        """The gateway's own directories: never a function's code_dir."""
        settings = self.settings
        dirs = [d for d in (settings.state_dir, settings.store_dir) if d is not None]
        if settings.admin_token_file is not None:
            dirs.append(settings.admin_token_file.parent.parent)
        return dirs

    async def remove(self, name: str) -> None:
        pool = self.pool(name)
        del self.pools[name]
        self._forget("functions", name)
        self._close_later(pool)
        self.metrics.forget_function(name)
        log.info("function %s removed; its instances drain and stop", name)

    def _close_later(self, pool: Pool) -> None:
        task = asyncio.create_task(
            pool.close(self.settings.drain_timeout_s), name=f"trims-close-{pool.name}"
        )
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def pool(self, name: str) -> Pool:
        pool = self.pools.get(name)
        if pool is None:
            raise NotFound(f"no function named {name!r}; GET /v1/functions lists them")
        return pool

    def describe(self, name: str) -> dict[str, Any]:
        pool = self.pool(name)
        return {"spec": pool.spec.to_dict(), "status": pool.describe()}

    async def invoke(
        self,
        name: str,
        body: bytes,
        headers: Mapping[str, str],
        traced: TracedCall | None = None,
    ) -> Outcome:
        """Run one request on the function; header names reach it lower-cased.

        ``traced``: the request asked for a trace (see :mod:`trims.runtime.gateway.traced`);
        the outcome then carries the ``trims-trace-*`` headers.
        """
        self._refuse_when_draining()
        pool = self.pool(name)
        passed = forwarded_headers(headers)
        started = time.monotonic()
        if traced is not None:
            return await self._invoke_traced(pool, body, passed, traced, started)
        status = "error"
        try:

            async def call(instance: Any, timeout: float) -> Outcome:
                if self.tracing:
                    with tracer.start_as_current_span("invoke", attributes={"function": name}):
                        reply = await instance.invoke(
                            body, passed, timeout=timeout, trace=inject_context()
                        )
                else:
                    reply = await instance.invoke(
                        body, passed, timeout=timeout, trace=_forwarded_trace(passed)
                    )
                return Outcome(int(reply.status), dict(reply.headers), bytes(reply.body))

            outcome = await pool.run(call)
            status = str(outcome.status)
            return outcome
        except TrimsError as e:
            status = str(e.http_status)
            raise
        finally:
            pool.count_invocation(status, started=started)

    async def infer(
        self,
        name: str,
        inputs: Mapping[str, np.ndarray],
        traced: TracedCall | None = None,
    ) -> dict[str, np.ndarray]:
        """Run the function's infer; with ``traced``, its headers land in ``traced`` (see
        :func:`trims.runtime.gateway.traced.response_headers`)."""
        self._refuse_when_draining()
        pool = self.pool(name)
        started = time.monotonic()
        status = "error"
        try:

            async def call(instance: Any, timeout: float) -> dict[str, np.ndarray]:
                if traced is None and not self.tracing:
                    # No span would be recorded: skip making one (the hot path).
                    return dict(await instance.infer(inputs, timeout=timeout, trace={}))
                with tracer.start_as_current_span("infer", attributes={"function": name}):
                    if traced is not None and hasattr(instance, "request"):
                        return await traced.infer(
                            instance,
                            inputs,
                            timeout=timeout,
                            carrier=inject_context() if self.tracing else {},
                            start_window=pool.start_window(instance.id),
                        )
                    out = await instance.infer(inputs, timeout=timeout, trace=inject_context())
                return dict(out)

            if traced is not None:
                traced.queued()
            result = await pool.run(call)
            status = "200"
            if traced is not None:
                self._finish_trace(traced)
            return result
        except TrimsError as e:
            status = str(e.http_status)
            raise
        finally:
            pool.count_invocation(status, protocol="v2", samples=_batch(inputs), started=started)

    async def _invoke_traced(
        self,
        pool: Pool,
        body: bytes,
        passed: Mapping[str, str],
        traced: TracedCall,
        started: float,
    ) -> Outcome:
        """:meth:`invoke` for a request that asked for a trace (kept apart from the hot path)."""
        status = "error"
        try:

            async def call(instance: Any, timeout: float) -> Outcome:
                carrier = _forwarded_trace(passed)
                if not hasattr(instance, "request"):
                    traced.error = f"instances of executor {instance.executor} carry no traces"
                    reply = await instance.invoke(body, passed, timeout=timeout, trace=carrier)
                    return Outcome(int(reply.status), dict(reply.headers), bytes(reply.body))
                if self.tracing:
                    with tracer.start_as_current_span("invoke", attributes={"function": pool.name}):
                        code, headers, out = await traced.invoke(
                            instance,
                            body,
                            passed,
                            timeout=timeout,
                            carrier=inject_context(),
                            start_window=pool.start_window(instance.id),
                        )
                else:
                    code, headers, out = await traced.invoke(
                        instance,
                        body,
                        passed,
                        timeout=timeout,
                        carrier=carrier,
                        start_window=pool.start_window(instance.id),
                    )
                return Outcome(code, dict(headers), bytes(out))

            traced.queued()
            outcome = await pool.run(call)
            status = str(outcome.status)
        except TrimsError as e:
            status = str(e.http_status)
            raise
        finally:
            pool.count_invocation(status, started=started)
        headers = {**outcome.headers, **self._finish_trace(traced)}
        return Outcome(outcome.status, headers, outcome.body)

    def _finish_trace(self, traced: TracedCall) -> dict[str, str]:
        """Assemble, keep and export the trace; count it; the response's trace headers."""
        trace_doc = traced.trace()
        self.traces.put(traced, trace_doc)
        self.trace_exporter.submit(trace_doc)
        self.metrics.traced.labels(traced.function, traced.level.label).inc()
        if traced.profiler_error:
            self.metrics.trace_failures.labels(traced.function).inc()
            log.warning(
                "trace %s of %s: profiling failed (%s); the result was returned",
                traced.trace_id, traced.function, traced.profiler_error,
            )  # fmt: skip
        headers = response_headers(traced)
        traced.headers = headers
        return headers

    def _refuse_when_draining(self) -> None:
        if self.draining:
            raise Unavailable("the gateway is shutting down; retry on another gateway")

    # -- pipelines -----------------------------------------------------------------------------

    def put_pipeline(self, spec: PipelineSpec) -> bool:
        missing = [f for f in spec.functions if f not in self.pools]
        if missing:
            raise ValidationError(
                f"pipeline {spec.name} uses undeployed function {missing[0]!r}; deploy it first"
            )
        created = spec.name not in self.pipelines
        self.pipelines[spec.name] = spec
        self._save("pipelines", spec.name, spec.to_dict())
        return created

    def pipeline(self, name: str) -> PipelineSpec:
        spec = self.pipelines.get(name)
        if spec is None:
            raise NotFound(f"no pipeline named {name!r}; GET /v1/pipelines lists them")
        return spec

    def remove_pipeline(self, name: str) -> None:
        self.pipeline(name)
        del self.pipelines[name]
        self._forget("pipelines", name)

    async def run_pipeline(self, name: str, body: bytes, content_type: str) -> Outcome:
        spec = self.pipeline(name)

        async def call(function: str, step_body: bytes, step_type: str) -> Outcome:
            return await self.invoke(function, step_body, {"Content-Type": step_type})

        return await run_pipeline(spec, body, content_type, call)

    # -- persistence ---------------------------------------------------------------------------

    def _save(self, kind: str, name: str, doc: dict[str, Any]) -> None:
        if self.settings.state_dir is None:
            return
        folder = self.settings.state_dir / kind
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / f"{name}.json", json.dumps(doc, indent=1))

    def _forget(self, kind: str, name: str) -> None:
        if self.settings.state_dir is None:
            return
        try:
            (self.settings.state_dir / kind / f"{name}.json").unlink()
        except FileNotFoundError:
            pass

    # -- metrics -------------------------------------------------------------------------------

    def _instance_counts(self) -> dict[str, dict[str, int]]:
        return {name: pool.counts() for name, pool in self.pools.items()}

    def _pending_counts(self) -> dict[str, int]:
        return {name: pool.pending for name, pool in self.pools.items()}


def _check_deploy(
    executor: Executor, spec: FunctionSpec, on_host: bool, store_socket: Path | None
) -> None:
    """What a deploy checks that may block: the executor's own check, then, where the files
    are on this host, that every model can be had from the store or from its source."""
    executor.check(spec)
    if on_host:
        check_models(spec, store_socket)


def _batch(inputs: Mapping[str, np.ndarray]) -> int:
    """Samples in an infer request: the first input's leading dimension (1 for a scalar)."""
    first = next(iter(inputs.values()), None)
    return int(first.shape[0]) if first is not None and first.ndim > 0 else 1


def tracing_enabled() -> bool:
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def _forwarded_trace(headers: Mapping[str, str]) -> Mapping[str, str]:
    parent = headers.get("traceparent")
    if parent is None:
        return _NO_TRACE
    state = headers.get("tracestate")
    return {"traceparent": parent, "tracestate": state} if state else {"traceparent": parent}


_NO_TRACE: Mapping[str, str] = {}
