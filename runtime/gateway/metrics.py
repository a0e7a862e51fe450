"""Prometheus metrics of one gateway, in its own registry (several gateways can share a process).

Latency is split the way a slow request is diagnosed: time waiting in the function's queue,
time spent starting an instance (cold start), and time the instance took to answer.

What a Triton user's dashboards expect has a counterpart here (Prometheus naming: base units,
``_total`` counters, ``_seconds``):

=========================================  =================================================
Triton                                     trims
=========================================  =================================================
``nv_inference_request_success/failure``   ``trims_inference_requests_total{function,
                                           version,protocol,outcome}`` (``/v1`` and ``/v2``
                                           apart)
``nv_inference_count``                     ``trims_inference_count_total`` (samples: the
                                           batch dimension of a ``/v2`` request, 1 per
                                           ``/v1`` invocation)
``nv_inference_exec_count``                ``trims_inference_exec_count_total`` (calls an
                                           instance answered; no dynamic batching, so one
                                           per request that reached an instance)
``nv_inference_request_duration_us``       ``trims_inference_request_duration_seconds``
                                           (end to end: queue, cold start, answer)
``nv_inference_queue_duration_us``         ``trims_queue_wait_seconds``
``nv_inference_compute_infer_duration_us`` ``trims_execution_seconds``
``nv_inference_pending_request_count``     ``trims_pending_requests{function}``
``nv_cpu_utilization``, memory             ``trims_node_cpu_utilization``,
                                           ``trims_node_memory_{used,total}_bytes``,
                                           and ``process_*`` of the gateway
=========================================  =================================================

Every request the gateway answers, including those it refuses itself (400, 401, 404, 413, 429),
is counted in ``trims_http_requests_total{route,method,status}`` with its duration, by route
template (``/v2/models/{name}/infer``), never by raw path, so a scanner cannot grow the series
set. Series of a removed function are dropped (:meth:`GatewayMetrics.forget_function`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from trims.runtime.gateway.loop_metrics import LoopCounter, LoopHistogram

_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

#: function -> state -> number of instances; called at scrape time.
InstanceCounts = Callable[[], Mapping[str, Mapping[str, int]]]
#: function -> requests waiting for an instance slot; called at scrape time.
PendingCounts = Callable[[], Mapping[str, int]]
#: (working set / memory limit, whether at or above the high watermark), None without a
#: memory limit; called at scrape time (:meth:`InstanceBudget.memory_state`).
MemoryStateReader = Callable[[], tuple[float, bool] | None]


class _InstancesCollector(Collector):
    def __init__(self, counts: InstanceCounts, pending: PendingCounts | None) -> None:
        self._counts = counts
        self._pending = pending

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "trims_instances", "Function instances by state", labels=["function", "state"]
        )
        for function, states in self._counts().items():
            for state, n in states.items():
                family.add_metric([function, state], n)
        yield family
        if self._pending is not None:
            pending = GaugeMetricFamily(
                "trims_pending_requests",
                "Requests waiting for an instance slot (queued, not yet executing)",
                labels=["function"],
            )
            for function, n in self._pending().items():
                pending.add_metric([function], n)
            yield pending


class _MemoryCollector(Collector):
    """The memory dimension of the node's instance budget, read at scrape time."""

    def __init__(self, state: MemoryStateReader) -> None:
        self._state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self._state()
        if state is None:
            return
        ratio, pressure = state
        yield GaugeMetricFamily(
            "trims_memory_usage_ratio",
            "The gateway's memory cgroup: working set (usage less inactive file pages) over "
            "its limit",
            value=ratio,
        )
        yield GaugeMetricFamily(
            "trims_memory_pressure",
            "1 while the working set is at or above the high watermark of the memory limit "
            "(new instances make room first or are refused), else 0",
            value=float(pressure),
        )


class _NodeCollector(Collector):
    """CPU utilization and memory of the node the gateway runs on (psutil), at scrape time."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        psutil.cpu_percent(None)  # the first call starts the interval the next one reports

    def collect(self) -> Iterator[GaugeMetricFamily]:
        memory = self._psutil.virtual_memory()
        yield GaugeMetricFamily(
            "trims_node_cpu_utilization",
            "CPU utilization of the node since the previous scrape, 0-1 (all cores)",
            value=self._psutil.cpu_percent(None) / 100.0,
        )
        yield GaugeMetricFamily(
            "trims_node_memory_used_bytes",
            "Memory in use on the node (total minus available)",
            value=memory.total - memory.available,
        )
        yield GaugeMetricFamily(
            "trims_node_memory_total_bytes", "Physical memory of the node", value=memory.total
        )


class GatewayMetrics:
    """The gateway's counters and histograms; ``render()`` is the /metrics body."""

    def __init__(
        self,
        instance_counts: InstanceCounts,
        pending: PendingCounts | None = None,
        memory: MemoryStateReader | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_requests = LoopCounter(
            "trims_http_requests",
            "HTTP requests the gateway answered, by route template, method and status (those "
            "it refused itself included)",
            ["route", "method", "status"],
            registry=r,
        )
        self.http_duration = LoopHistogram(
            "trims_http_request_duration_seconds",
            "Time from a request's arrival to its response, by route template and method",
            ["route", "method"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.inference_requests = LoopCounter(
            "trims_inference_requests",
            "Requests to a function (model) by version, protocol (v1 invoke, v2 infer) and "
            "outcome (success: 2xx; failure: anything else)",
            ["function", "version", "protocol", "outcome"],
            registry=r,
        )
        self.inference_count = LoopCounter(
            "trims_inference_count",
            "Samples inferred: the batch dimension of each successful v2 request, 1 per v1 call",
            ["function", "version"],
            registry=r,
        )
        self.inference_exec_count = LoopCounter(
            "trims_inference_exec_count",
            "Calls an instance answered (executions; one per request, there is no batching)",
            ["function", "version"],
            registry=r,
        )
        self.inference_duration = LoopHistogram(
            "trims_inference_request_duration_seconds",
            "End-to-end time of a function request in the gateway (queue, cold start, answer)",
            ["function", "version", "protocol"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.invocations = LoopCounter(
            "trims_invocations",
            "Invocations by function and HTTP status",
            ["function", "status"],
            registry=r,
        )
        self.queue_wait = LoopHistogram(
            "trims_queue_wait_seconds",
            "Time a request waited for an instance slot",
            ["function"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.cold_start = LoopHistogram(
            "trims_cold_start_seconds",
            "Time from starting an instance to its init() having run",
            ["function"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.execution = LoopHistogram(
            "trims_execution_seconds",
            "Time an instance took to answer one request",
            ["function"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.cold_starts = LoopCounter(
            "trims_cold_starts", "Instances started", ["function"], registry=r
        )
        self.instance_failures = LoopCounter(
            "trims_instance_failures",
            "Instances that died or failed to start",
            ["function"],
            registry=r,
        )
        self.instance_stops = LoopCounter(
            "trims_instance_stops",
            "Instances the gateway stopped while healthy, by reason: idle_timeout, "
            "memory_pressure, count_limit or store_capacity (to make room for another "
            "instance; store_capacity: the model store refused its models)",
            ["function", "reason"],
            registry=r,
        )
        self.admissions_refused = LoopCounter(
            "trims_admissions_refused",
            "Requests refused with 503 because no instance could start, by reason (memory: "
            "the node's memory was at its high watermark with nothing idle to stop; store: "
            "the model store could not fit the function's models with nothing idle to stop)",
            ["function", "reason"],
            registry=r,
        )
        self.model_acquire = LoopHistogram(
            "trims_model_acquire_seconds",
            "Model acquire time reported by instances",
            ["function"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.traced = LoopCounter(
            "trims_traced_invocations",
            "Invocations that asked for a trace (trims-trace-level), by function and level",
            ["function", "level"],
            registry=r,
        )
        self.trace_failures = LoopCounter(
            "trims_trace_failures",
            "Traced invocations whose profiler failed (the result was still returned)",
            ["function"],
            registry=r,
        )
        self.pipeline_stage = LoopHistogram(
            "trims_pipeline_stage_seconds",
            "Time one step of a pipeline took (its function call as the gateway saw it: queue, "
            "cold start, answer); stage 'total' is the whole run",
            ["pipeline", "stage"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.pipeline_invocations = LoopCounter(
            "trims_pipeline_invocations",
            "Pipeline runs by pipeline and HTTP status",
            ["pipeline", "status"],
            registry=r,
        )
        r.register(_InstancesCollector(instance_counts, pending))
        if memory is not None:
            r.register(_MemoryCollector(memory))
        r.register(_NodeCollector())
        ProcessCollector(registry=r)
        #: (route, method, status) -> its two HTTP series: ``labels()`` builds a key on every
        #: call, so the children are looked up once. Bounded like the series set itself (route
        #: templates x methods x statuses).
        self._http_children: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    def http_series(self, route: str, method: str, status: int) -> tuple[Any, Any]:
        """The request counter and duration histogram children of one route, method, status."""
        key = (route, method, status)
        series = self._http_children.get(key)
        if series is None:
            series = self._http_children[key] = (
                self.http_requests.labels(route, method, str(status)),
                self.http_duration.labels(route, method),
            )
        return series

    #: The labelled metrics whose series name a function, with their label names.
    def _by_function(self) -> list[tuple[MetricWrapperBase, tuple[str, ...]]]:
        return [
            (self.invocations, ("function", "status")),
            (self.queue_wait, ("function",)),
            (self.cold_start, ("function",)),
            (self.execution, ("function",)),
            (self.cold_starts, ("function",)),
            (self.instance_failures, ("function",)),
            (self.instance_stops, ("function", "reason")),
            (self.admissions_refused, ("function", "reason")),
            (self.model_acquire, ("function",)),
            (self.traced, ("function", "level")),
            (self.trace_failures, ("function",)),
            (self.inference_requests, ("function", "version", "protocol", "outcome")),
            (self.inference_count, ("function", "version")),
            (self.inference_exec_count, ("function", "version")),
            (self.inference_duration, ("function", "version", "protocol")),
        ]

    def forget_function(self, function: str) -> None:
        """Drop every series of ``function`` (it was removed): a dashboard shows no stale
        function, and deploying many short-lived functions does not grow the series set."""
        for metric, names in self._by_function():
            seen = set()
            for family in metric.collect():
                for sample in family.samples:
                    if sample.labels.get("function") == function:
                        seen.add(tuple(sample.labels[n] for n in names))
            for values in seen:
                metric.remove(*values)

    def render(self) -> bytes:
        return generate_latest(self.registry)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def http_metrics_middleware(metrics: GatewayMetrics) -> Callable[..., Awaitable[Any]]:
    """An aiohttp middleware counting every request by its route template and status, the
    gateway's own refusals included (it runs outside the error middleware)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.monotonic()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        finally:
            info = request.match_info.route.resource
            route = info.canonical if info is not None else "unmatched"
            method = request.method if request.method in _METHODS else "other"
            series = metrics.http_series(route, method, status)
            series[0].inc()
            series[1].observe(time.monotonic() - started)

    return middleware


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
