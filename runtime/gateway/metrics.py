"""Prometheus metrics of one gateway, in its own registry (several gateways can share a process).

Latency is split the way a slow request is diagnosed: time waiting in the function's queue,
time spent starting an instance (cold start), and time the instance took to answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

#: function -> state -> number of instances; called at scrape time.
InstanceCounts = Callable[[], Mapping[str, Mapping[str, int]]]


class _InstancesCollector(Collector):
    def __init__(self, counts: InstanceCounts) -> None:
        self._counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "trims_instances", "Function instances by state", labels=["function", "state"]
        )
        for function, states in self._counts().items():
            for state, n in states.items():
                family.add_metric([function, state], n)
        yield family


class GatewayMetrics:
    """The gateway's counters and histograms; ``render()`` is the /metrics body."""

    def __init__(self, instance_counts: InstanceCounts) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.invocations = Counter(
            "trims_invocations",
            "Invocations by function and HTTP status",
            ["function", "status"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "trims_queue_wait_seconds",
            "Time a request waited for an instance slot",
            ["function"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.cold_start = Histogram(
            "trims_cold_start_seconds",
            "Time from starting an instance to its init() having run",
            ["function"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.execution = Histogram(
            "trims_execution_seconds",
            "Time an instance took to answer one request",
            ["function"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.cold_starts = Counter(
            "trims_cold_starts", "Instances started", ["function"], registry=r
        )
        self.instance_failures = Counter(
            "trims_instance_failures",
            "Instances that died or failed to start",
            ["function"],
            registry=r,
        )
        self.model_acquire = Histogram(
            "trims_model_acquire_seconds",
            "Model acquire time reported by instances",
            ["function"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.traced = Counter(
            "trims_traced_invocations",
            "Invocations that asked for a trace (trims-trace-level), by function and level",
            ["function", "level"],
            registry=r,
        )
        self.trace_failures = Counter(
            "trims_trace_failures",
            "Traced invocations whose profiler failed (the result was still returned)",
            ["function"],
            registry=r,
        )
        self.pipeline_stage = Histogram(
            "trims_pipeline_stage_seconds",
            "Time one step of a pipeline took (its function call as the gateway saw it: queue, "
            "cold start, answer); stage 'total' is the whole run",
            ["pipeline", "stage"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.pipeline_invocations = Counter(
            "trims_pipeline_invocations",
            "Pipeline runs by pipeline and HTTP status",
            ["pipeline", "status"],
            registry=r,
        )
        r.register(_InstancesCollector(instance_counts))

    def render(self) -> bytes:
        return generate_latest(self.registry)
