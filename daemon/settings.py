"""The daemon's settings: tier budgets, eviction policies, per-peer server limits.

Frozen dataclasses built once in ``trims daemon``'s ``main()`` from argv and the environment
(``TRIMS_*``); each field says its unit, default and why.
"""

from __future__ import annotations

from dataclasses import field
from pathlib import Path

from pydantic.dataclasses import dataclass

from trims.config import admin_socket_for
from trims.daemon.tiers.cpu import CPU_BACKINGS
from trims.errors import ValidationError
from trims.protocol import MAX_REQUEST_FRAME

EVICTION_POLICIES = ("lru", "lfu", "fifo", "never")


@dataclass(frozen=True)
class TierBudgets:
    """Byte budgets per tier; 0 disables a tier (gpu defaults to 0 where there is no GPU)."""

    #: Host memory for the CPU tier's models. `trims daemon` sizes it from the memory it may
    #: really use (:func:`size_cpu_budget`); 8 GiB is the fallback where that is unknown.
    cpu: int = 8 << 30
    #: Local disk for the content-addressed layouts. Default 64 GiB.
    disk: int = 64 << 30
    #: Device memory per GPU. Default 0 (off) so a CPU node never tries to use CUDA.
    gpu: int = 0


#: Share of the memory limit the CPU tier takes when no budget is configured. The daemon's
#: cgroup is charged for every model in the CPU tier (memfd and page-cache pages belong to
#: the cgroup that first touched them: the daemon, which loaded them), and where the daemon,
#: the gateway and the instances share one limit (``trims up``, one container, a benchmark's
#: cgroup) the instances' own memory (interpreters, frameworks, activations, copy-on-write
#: pages) and a load's transient second copy (the blob in the page cache beside its memfd)
#: must fit in the rest. Half leaves that room; a daemon alone in its cgroup (a DaemonSet
#: pod with a memory limit) may be given up to :func:`cpu_budget_ceiling` with --cpu-budget.
CPU_BUDGET_SHARE = 0.5
#: Memory the daemon keeps for itself beside the CPU tier, at most a quarter of the limit:
#: the interpreter and its imports (~60 MiB), the catalog, read buffers (64 MiB at most) and
#: a model being hashed or converted. A budget above ``limit - reserve`` would have the kernel
#: OOM-kill the daemon, and with it every lease on the node, before eviction ever ran.
DAEMON_MEMORY_RESERVE = 256 << 20


def cpu_budget_ceiling(limit: int) -> int:
    """The largest CPU-tier budget a daemon limited to ``limit`` bytes can hold."""
    return limit - min(DAEMON_MEMORY_RESERVE, limit // 4)


def size_cpu_budget(configured: int | None, limit: int | None) -> int:
    """The CPU tier's budget: ``configured`` (None: not given) within a memory ``limit``
    (None: unknown; :attr:`trims.cgroup.MemoryCgroup.limit_bytes`).

    Unconfigured: :data:`CPU_BUDGET_SHARE` of the limit, or the 8 GiB fallback where the
    limit is unknown. Configured above :func:`cpu_budget_ceiling`: that ceiling (the caller
    says so in a warning); otherwise as configured.
    """
    if limit is None:
        return TierBudgets().cpu if configured is None else configured
    if configured is None:
        return int(limit * CPU_BUDGET_SHARE)
    return min(configured, cpu_budget_ceiling(limit))


@dataclass(frozen=True)
class ServerLimits:
    """What one peer may take of the daemon's socket server (see ``trims.daemon.server``)."""

    #: Connections open at once on the store socket, all uids together. Default 4096: more
    #: than the function instances one node runs, and a bound on the daemon's descriptors.
    max_connections: int = 4096
    #: Connections one uid may hold open on the store socket; root and the daemon's owner get no
    #: exemption. Default 256: every instance holds one connection, and the local executor's
    #: workers connect before they drop privileges, so they all count as the gateway's uid;
    #: 16 uids would be needed to fill the total. Raise it where one uid runs more instances.
    max_connections_per_uid: int = 256
    #: Connections of the admin socket (owner and root only), counted apart from the store
    #: socket's, so a flood there never blocks administration. Default 16: CLI calls are short.
    max_admin_connections: int = 16
    #: Seconds within which a request frame that has started arriving must be complete, else
    #: the connection gets an error and is closed. Default 10 s: a request is at most
    #: ``max_request_frame`` bytes on a local socket (microseconds); 10 s tolerates a stalled
    #: client while stopping a slow-loris peer from holding buffers.
    read_timeout: float = 10.0
    #: Seconds a connection may stay silent while it holds no lease and has no request in
    #: flight before it is closed; 0 disables. Default 60 s. A connection holding a lease is
    #: never closed for idleness: the lease lives as long as the connection.
    idle_timeout: float = 60.0
    #: Largest request payload read, in bytes. Default 64 KiB (``MAX_REQUEST_FRAME``): the
    #: largest legitimate request, an ``add`` with a 4096-character source, is ~5 KiB; replies
    #: (manifests) keep the protocol's 16 MiB ``MAX_FRAME``.
    max_request_frame: int = MAX_REQUEST_FRAME
    #: Bytes of partially read requests buffered across all connections; at the limit the
    #: daemon stops reading until some frees. Default 64 MiB: 1024 connections can each hold a
    #: full request at once; beyond that, readers wait their turn.
    read_buffer_total: int = 64 << 20
    #: Log lines about one uid (bad frames, refused, timed-out and ended connections) written
    #: per ``peer_log_interval``; the rest are counted and summarized. Default 10: a client
    #: that connects, acquires and disconnects in a loop writes one line a second at most.
    peer_log_burst: int = 10
    #: Seconds over which ``peer_log_burst`` lines per uid are allowed. Default 10 s.
    peer_log_interval: float = 10.0

    def __post_init__(self) -> None:
        for name in (
            "max_connections",
            "max_connections_per_uid",
            "max_admin_connections",
            "max_request_frame",
            "read_buffer_total",
            "peer_log_burst",
        ):
            if getattr(self, name) < 1:
                raise ValidationError(f"{name} must be at least 1, not {getattr(self, name)}")
        for name in ("read_timeout", "peer_log_interval"):
            if not getattr(self, name) > 0:
                raise ValidationError(f"{name} must be a positive number of seconds")
        if not self.idle_timeout >= 0:
            raise ValidationError("idle_timeout must be 0 (off) or a positive number of seconds")
        if self.read_buffer_total < self.max_request_frame:
            raise ValidationError(
                f"read_buffer_total ({self.read_buffer_total} bytes) must hold at least one "
                f"request of max_request_frame ({self.max_request_frame} bytes)"
            )


@dataclass(frozen=True)
class DaemonSettings:
    """Everything `trims daemon` needs; built once in its main()."""

    #: Directory of the catalog (SQLite) and the disk tier. Must be on a local filesystem.
    store_dir: Path
    #: The store socket (acquire/release/info/list/stats). Its admin twin sits beside it.
    socket_path: Path
    #: Mode of the store socket. 0660: the owner and the configured group may connect.
    socket_mode: int = 0o660
    #: Group that may connect to the store socket (name or gid); None keeps the daemon's group.
    socket_group: str | None = None
    budgets: TierBudgets = field(default_factory=TierBudgets)
    #: How the CPU tier holds a model: "memfd" (a sealed copy), "file" (the verified disk file
    #: kept in the page cache) or "auto": file for a root daemon where shmem huge pages are off
    #: (a 4 KiB-page memfd maps 10x slower), memfd otherwise (Note [page-cache copies] in
    #: trims.daemon.tiers.pagecache).
    cpu_backing: str = "auto"
    #: Eviction policy per tier, one of EVICTION_POLICIES. LRU suits serving traffic.
    eviction: str = "lru"
    #: S3 endpoint for s3:// sources (any S3-compatible store); None uses AWS defaults.
    s3_endpoint: str | None = None
    #: OTLP/HTTP endpoint for traces; None exports nothing.
    otlp_endpoint: str | None = None
    #: Address for the Prometheus /metrics endpoint ("host:port"); None disables it.
    metrics_address: str | None = None
    #: Tests only (hidden option --crash-point): the step of the add/remove commit protocol at
    #: which the daemon SIGKILLs itself (trims.daemon.crashpoints.POINTS); None in production.
    crash_point: str | None = None
    #: Connection, timeout, buffer and log limits of the socket server, per peer and in total.
    limits: ServerLimits = field(default_factory=ServerLimits)
    #: Seconds a remote source (the model file and its external data together) may take to
    #: download before the ``add`` fails. Default 3600 s: tens of GiB on an ordinary link, while
    #: a server that trickles a byte now and then cannot hold an ``add`` (and its disk space)
    #: forever.
    download_deadline: float = 3600.0
    #: Seconds a download may wait for a connection or for its next byte. Default 60 s: rides
    #: out a busy server; a silent one is cut off long before the deadline.
    download_stall_timeout: float = 60.0
    #: Share of the memory limit at which unleased CPU-tier copies are demoted to the disk
    #: tier, and which a load into the CPU tier may not take the working set past (Note
    #: [memory pressure] in trims.daemon.pressure); None: off. Counts only where a cgroup
    #: limits the daemon below the machine's memory. Default 0.9, as the gateway's: the last
    #: tenth is room for what grows between two checks (an instance's activations, a request
    #: buffer) before the kernel OOM-kills at the limit.
    memory_high_watermark: float | None = 0.9
    #: Share of the limit that demotion, once started, brings the working set under. Default
    #: 0.8: stopping just under the high watermark would demote one copy per check while the
    #: other processes grow, and every demoted model costs a load when it is next used.
    memory_low_watermark: float = 0.8
    #: Seconds between checks of the cgroup's memory (beside the check at each load into the
    #: CPU tier). Default 1 s: the other processes of a shared cgroup grow by an instance's
    #: start or a burst of requests in about that, and a check reads three small files.
    memory_check_interval: float = 1.0

    def __post_init__(self) -> None:
        high, low = self.memory_high_watermark, self.memory_low_watermark
        if high is not None and not 0 < low < high <= 1:
            raise ValidationError(
                f"memory watermarks must satisfy 0 < low < high <= 1 (shares of the memory "
                f"limit), not low {low} and high {high}; e.g. --memory-low-watermark 0.8 "
                "--memory-high-watermark 0.9"
            )
        if not self.memory_check_interval > 0:
            raise ValidationError("memory_check_interval must be a positive number of seconds")
        if self.eviction not in EVICTION_POLICIES:
            raise ValidationError(
                f"unknown eviction policy {self.eviction!r}; use one of {EVICTION_POLICIES}"
            )
        if self.cpu_backing not in CPU_BACKINGS:
            raise ValidationError(
                f"unknown cpu backing {self.cpu_backing!r}; use one of {CPU_BACKINGS}"
            )
        for name in ("download_deadline", "download_stall_timeout"):
            if not getattr(self, name) > 0:
                raise ValidationError(f"{name} must be a positive number of seconds")

    @property
    def admin_socket_path(self) -> Path:
        return admin_socket_for(self.socket_path)
