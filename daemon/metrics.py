"""Prometheus metrics of the daemon, in their own registry, served over HTTP when configured."""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from trims.cgroup import memory_cgroup
from trims.errors import ValidationError

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
)


@dataclass
class DaemonMetrics:
    """Every metric the daemon exports; one instance per daemon."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.bytes_used = Gauge(
            "trims_tier_bytes_used", "Bytes of resident models per tier", ["tier"], registry=r
        )
        self.bytes_budget = Gauge(
            "trims_tier_bytes_budget", "Byte budget per tier (0: disabled)", ["tier"], registry=r
        )
        self.models_resident = Gauge(
            "trims_tier_models_resident", "Models resident per tier", ["tier"], registry=r
        )
        self.leases = Gauge("trims_leases_live", "Live leases", registry=r)
        self.connections = Gauge("trims_connections", "Open client connections", registry=r)
        self.acquire_latency = Histogram(
            "trims_acquire_seconds",
            "Time from acquire request to reply, by the tier that served it",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.loads = Counter("trims_loads", "Model loads into a tier", ["tier"], registry=r)
        self.load_duration = Histogram(
            "trims_load_seconds",
            "Duration of a model load into a tier",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.hashed_bytes = Counter(
            "trims_verified_bytes",
            "Bytes hashed to verify a model's copy against its digest, by tier",
            ["tier"],
            registry=r,
        )
        self.damaged = Counter(
            "trims_damaged_copies",
            "Copies that failed their digest check, by the tier whose check found it; the disk "
            "copy is deleted each time (alert on any increase)",
            ["tier"],
            registry=r,
        )
        self.evictions = Counter(
            "trims_evictions", "Models evicted from a tier", ["tier"], registry=r
        )
        self.errors = Counter("trims_errors", "Error replies by error code", ["code"], registry=r)
        self.protocol_errors = Counter(
            "trims_protocol_errors",
            "Malformed request frames, by reason (trims.protocol.DECODE_REASONS)",
            ["reason"],
            registry=r,
        )
        self.connections_refused = Counter(
            "trims_connections_refused",
            "Connections refused at accept, by the limit that refused them (total, per_uid, admin)",
            ["reason"],
            registry=r,
        )
        self.connections_closed = Counter(
            "trims_connections_closed",
            "Connections the daemon closed, by reason (idle, read_timeout, protocol)",
            ["reason"],
            registry=r,
        )
        self.read_buffer_bytes = Gauge(
            "trims_read_buffer_bytes",
            "Bytes reserved for request frames being read, all connections together",
            registry=r,
        )
        self.log_suppressed = Counter(
            "trims_log_suppressed",
            "Log lines about a peer dropped by the per-uid log rate limit",
            registry=r,
        )
        # Read at each scrape: a limit can change under a running daemon (a pod resized in
        # place), and usage is what the kernel's OOM killer compares with it.
        self.memory_limit = Gauge(
            "trims_daemon_memory_limit_bytes",
            "Memory the daemon may use: its memory cgroup's limit (the smallest of the cgroup's "
            "and its ancestors'), at most the machine's memory; NaN where unknown",
            registry=r,
        )
        self.memory_limit.set_function(lambda: _or_nan(memory_cgroup().limit_bytes))
        self.memory_usage = Gauge(
            "trims_daemon_memory_usage_bytes",
            "Memory the daemon's cgroup is charged now (its processes, page cache and the CPU "
            "tier's models); NaN without a memory cgroup",
            registry=r,
        )
        self.memory_usage.set_function(lambda: _or_nan(memory_cgroup().usage_bytes))
        self.memory_working_set = Gauge(
            "trims_daemon_memory_working_set_bytes",
            "The cgroup's usage less its inactive file pages (which the kernel reclaims before "
            "it kills): what memory pressure compares with the watermarks; NaN without a "
            "memory cgroup",
            registry=r,
        )
        self.memory_working_set.set_function(lambda: _or_nan(memory_cgroup().working_set_bytes))
        self.memory_pressure = Gauge(
            "trims_daemon_memory_pressure",
            "1 from a check that found the working set at or above the high watermark of the "
            "limit until one finds it under the low watermark, else 0 (also 0 where no cgroup "
            "limits the daemon)",
            registry=r,
        )
        self.demotions = Counter(
            "trims_daemon_demotions",
            "Model copies that left a memory tier while their layout stays on disk, by tier and "
            "reason: budget (room for another load), memory_pressure, request (evict), changed "
            "(the disk file changed or was deleted), removed (the model was)",
            ["tier", "reason"],
            registry=r,
        )
        self.loads_refused = Counter(
            "trims_daemon_loads_refused",
            "Loads into a memory tier refused with resource_exhausted, by tier and reason: "
            "memory (past the high watermark with nothing unleased to demote), budget (the "
            "tier's budget held by leased or pinned copies)",
            ["tier", "reason"],
            registry=r,
        )
        self.acquires_degraded = Counter(
            "trims_daemon_acquires_degraded",
            "Acquires answered from the disk tier because the tier they asked for could not "
            "hold the model, by the tier asked for and the reason its load was refused: memory "
            "(past the high watermark), budget (the tier's budget held by leased or pinned "
            "copies, or smaller than the model), disabled (budget 0)",
            ["tier", "reason"],
            registry=r,
        )


def _or_nan(value: int | None) -> float:
    return math.nan if value is None else float(value)


class MetricsServer:
    """The /metrics HTTP endpoint (prometheus_client's server in a daemon thread)."""

    def __init__(self, metrics: DaemonMetrics, address: str) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValidationError(
                f"invalid metrics address {address!r}: use host:port, e.g. 127.0.0.1:9464"
            )
        self._server: WSGIServer
        self._thread: threading.Thread
        self._server, self._thread = start_http_server(
            int(port), addr=host, registry=metrics.registry
        )
        self.host = host
        self.port = int(self._server.server_port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
