"""`trims daemon`: run the node model store on its two Unix sockets until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trims.cgroup import MemoryCgroup, memory_cgroup
from trims.config import data_dir, default_socket, format_size, parse_size
from trims.daemon.private import private_log
from trims.daemon.settings import (
    CPU_BUDGET_SHARE,
    EVICTION_POLICIES,
    DaemonSettings,
    ServerLimits,
    TierBudgets,
    size_cpu_budget,
)
from trims.daemon.tiers.cpu import CPU_BACKINGS
from trims.errors import ValidationError
from trims.telemetry import otlp_endpoint_from_env, setup_logging, setup_tracing

log = logging.getLogger(__name__)

_TIER_NAMES = ("cpu", "gpu", "disk")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store-dir",
        help="catalog and disk tier, the daemon's user's alone: made 0700, tightened if looser, "
        "refused if another user owns it [$TRIMS_STORE_DIR]",
    )
    parser.add_argument("--socket", help="store socket path [$TRIMS_SOCKET]")
    parser.add_argument("--socket-mode", help="store socket mode, octal [0660]")
    parser.add_argument("--socket-group", help="group that may connect [$TRIMS_SOCKET_GROUP]")
    parser.add_argument(
        "--cpu-budget",
        help="host memory for models, e.g. 8GiB; at most the daemon's memory limit (its "
        "cgroup's, else the machine's) less a reserve for itself, larger values are lowered "
        "to that [half the limit; $TRIMS_CPU_BUDGET]",
    )
    parser.add_argument(
        "--cpu-backing",
        choices=CPU_BACKINGS,
        help="how the cpu tier holds models. memfd: a sealed copy; no process, root included, "
        "can change a model once clients map it. file: the verified disk blob in the page "
        "cache, first read 1.7-3x faster where shmem pages are 4 KiB; root (and the daemon's "
        "uid) can still write it under descriptors already handed out: the next acquire sees "
        "its stamp moved and hashes it again, but existing mappings see the change. auto: "
        "file for a root daemon where shmem huge pages are off, memfd otherwise (see "
        "docs/store.md) [auto; $TRIMS_CPU_BACKING]",
    )
    parser.add_argument(
        "--memory-high-watermark",
        help="share of the memory limit (where a cgroup limits the daemon) at which unleased "
        "models leave the cpu tier for the disk tier, and past which a load into the cpu tier "
        "is refused when nothing can leave; 'off': neither (see docs/store.md) "
        "[0.9; $TRIMS_MEMORY_HIGH_WATERMARK]",
    )
    parser.add_argument(
        "--memory-low-watermark",
        help="share of the memory limit that demotion brings memory under "
        "[0.8; $TRIMS_MEMORY_LOW_WATERMARK]",
    )
    parser.add_argument("--disk-budget", help="disk for models [64GiB; $TRIMS_DISK_BUDGET]")
    parser.add_argument("--gpu-budget", help="device memory per GPU [0 = off; $TRIMS_GPU_BUDGET]")
    parser.add_argument(
        "--eviction",
        help="policy for all tiers (lru, lfu, fifo, never) or per tier, e.g. "
        "'lru,gpu=never' [lru; $TRIMS_EVICTION]",
    )
    parser.add_argument("--s3-endpoint", help="S3-compatible endpoint [$TRIMS_S3_ENDPOINT]")
    parser.add_argument(
        "--metrics-address", help="serve Prometheus /metrics on host:port [$TRIMS_METRICS_ADDRESS]"
    )
    parser.add_argument("--otlp-endpoint", help="OTLP/HTTP trace endpoint [$TRIMS_OTLP_ENDPOINT]")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING [INFO; $TRIMS_LOG_LEVEL]")
    parser.add_argument(
        "--download-deadline",
        help="seconds a remote model may take to download [3600; $TRIMS_DOWNLOAD_DEADLINE]",
    )
    parser.add_argument(
        "--download-stall-timeout",
        help="seconds a download may wait for its next byte [60; $TRIMS_DOWNLOAD_STALL_TIMEOUT]",
    )
    # Tests only: kill the daemon at a step of the commit protocol (trims.daemon.crashpoints).
    parser.add_argument("--crash-point", help=argparse.SUPPRESS)
    _configure_limits(parser)


#: Flags of ServerLimits (one per field; also $TRIMS_<FIELD>): field, help, parser.
_LIMIT_FLAGS: tuple[tuple[str, str, Callable[[str], float]], ...] = (
    ("max_connections", "connections on the store socket, all uids [4096]", int),
    ("max_connections_per_uid", "store-socket connections of one uid, root included [256]", int),
    ("max_admin_connections", "admin-socket connections, reserved apart [16]", int),
    ("read_timeout", "seconds to finish a frame once it started [10]", float),
    ("idle_timeout", "seconds before closing a connection without leases or requests; "
     "0 = never [60]", float),
    ("max_request_frame", "largest request frame, e.g. 64KiB [64KiB]", parse_size),
    ("read_buffer_total", "bytes of partial requests buffered, all connections [64MiB]",
     parse_size),
    ("peer_log_burst", "log lines about one uid per interval [10]", int),
    ("peer_log_interval", "seconds of that interval [10]", float),
)  # fmt: skip


def _configure_limits(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection limits (per peer; see trims.daemon.server)")
    for name, help_text, _ in _LIMIT_FLAGS:
        group.add_argument(
            "--" + name.replace("_", "-"), help=f"{help_text[:-1]}; $TRIMS_{name.upper()}]"
        )


def build_limits(args: argparse.Namespace, env: Mapping[str, str]) -> ServerLimits:
    """ServerLimits from argv, then TRIMS_* environment, then the defaults."""
    values: dict[str, Any] = {}
    for name, _, parse in _LIMIT_FLAGS:
        text = getattr(args, name, None)
        if text is None:
            text = env.get(f"TRIMS_{name.upper()}") or None
        if text is None:
            continue
        try:
            values[name] = parse(text)
        except (ValueError, ValidationError) as e:
            raise ValidationError(
                f"invalid --{name.replace('_', '-')} {text!r}: use a {parse.__name__} value"
            ) from e
    return ServerLimits(**values)


def _download_limits(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, float]:
    """download_deadline and download_stall_timeout from argv, then $TRIMS_*, if given."""
    values: dict[str, float] = {}
    for name in ("download_deadline", "download_stall_timeout"):
        text = getattr(args, name, None) or env.get(f"TRIMS_{name.upper()}") or None
        if text is None:
            continue
        try:
            values[name] = float(text)
        except ValueError as e:
            raise ValidationError(
                f"invalid --{name.replace('_', '-')} {text!r}: use a number of seconds"
            ) from e
    return values


def _memory_watermarks(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, Any]:
    """memory_high_watermark ("off": None) and memory_low_watermark from argv, then $TRIMS_*,
    if given."""
    values: dict[str, Any] = {}
    for name in ("memory_high_watermark", "memory_low_watermark"):
        text = getattr(args, name, None) or env.get(f"TRIMS_{name.upper()}") or None
        if text is None:
            continue
        if name == "memory_high_watermark" and text.strip().lower() == "off":
            values[name] = None
            continue
        try:
            values[name] = float(text)
        except ValueError as e:
            raise ValidationError(
                f"invalid --{name.replace('_', '-')} {text!r}: use a share of the memory "
                "limit, e.g. 0.9" + (", or 'off'" if name == "memory_high_watermark" else "")
            ) from e
    return values


def parse_eviction(spec: str) -> tuple[str, dict[str, str]]:
    """'lru' -> ('lru', {}); 'lfu,gpu=never' -> ('lfu', {'gpu': 'never'})."""
    default = "lru"
    per_tier: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        tier, eq, policy = part.rpartition("=")
        if policy not in EVICTION_POLICIES or (eq and tier not in _TIER_NAMES):
            raise ValidationError(
                f"invalid eviction spec {spec!r}: use a policy of {EVICTION_POLICIES}, "
                f"optionally per tier as TIER=POLICY with TIER in {_TIER_NAMES}"
            )
        if eq:
            per_tier[tier] = policy
        else:
            default = policy
    return default, per_tier


def log_level(args: argparse.Namespace, env: Mapping[str, str]) -> str:
    """--log-level, then $TRIMS_LOG_LEVEL, then INFO."""
    return str(args.log_level or env.get("TRIMS_LOG_LEVEL") or "INFO")


def cpu_budget(configured: int | None, memory: MemoryCgroup) -> int:
    """The CPU tier's budget within the daemon's memory limit, saying how it was chosen."""
    limit = memory.limit_bytes
    budget = size_cpu_budget(configured, limit)
    where = (
        f"the limit of memory cgroup {memory.path} (v{memory.version}), at most the machine's"
        if memory.version
        else "the machine's memory, no memory cgroup found"
    )
    if limit is None:
        log.warning(
            "cannot read this daemon's memory limit (no cgroup files, no /proc/meminfo): cpu "
            "tier budget %s, not checked against memory; set --cpu-budget to fit the node",
            format_size(budget),
        )
    elif configured is None:
        log.info(
            "cpu tier budget %s: %d%% of the %s this daemon may use (%s); --cpu-budget sets it",
            format_size(budget),
            round(CPU_BUDGET_SHARE * 100),
            format_size(limit),
            where,
        )
    elif budget < configured:
        log.warning(
            "--cpu-budget %s is more than this daemon may use: its memory limit is %s (%s); "
            "using %s, the limit less a reserve for the daemon itself, so that eviction, not "
            "an OOM kill, keeps the tier within memory: lower --cpu-budget or raise the limit",
            format_size(configured),
            format_size(limit),
            where,
            format_size(budget),
        )
    return budget


def build_settings(
    args: argparse.Namespace, env: Mapping[str, str], *, memory: MemoryCgroup | None = None
) -> tuple[DaemonSettings, dict[str, str], str]:
    """Settings from argv, then TRIMS_* environment, then defaults; the CPU tier's budget
    within ``memory`` (default: this process's memory cgroup, read now).

    A configured CPU budget above what the memory limit leaves is lowered to fit, with a
    warning, rather than refused: the limit is often set by someone other than whoever wrote
    the budget (one chart value for nodes of several sizes, a pod limit changed later), and
    refusing would leave the node with no store, and every function on it without models,
    where a smaller budget only evicts sooner. The budget used is exported as
    ``trims_tier_bytes_budget``.
    """

    def pick(value: str | None, var: str) -> str | None:
        return value if value is not None else (env.get(var) or None)

    defaults = TierBudgets()
    budgets = {}
    for tier in ("disk", "gpu"):
        text = pick(getattr(args, f"{tier}_budget"), f"TRIMS_{tier.upper()}_BUDGET")
        budgets[tier] = parse_size(text) if text is not None else getattr(defaults, tier)
    cpu_text = pick(args.cpu_budget, "TRIMS_CPU_BUDGET")
    budgets["cpu"] = cpu_budget(
        parse_size(cpu_text) if cpu_text is not None else None,
        memory_cgroup() if memory is None else memory,
    )
    mode_text = pick(args.socket_mode, "TRIMS_SOCKET_MODE") or "660"
    try:
        mode = int(mode_text, 8)
    except ValueError as e:
        raise ValidationError(f"invalid --socket-mode {mode_text!r}: use octal, e.g. 660") from e
    default_policy, per_tier = parse_eviction(pick(args.eviction, "TRIMS_EVICTION") or "lru")
    store_dir = pick(args.store_dir, "TRIMS_STORE_DIR")
    socket_path = pick(args.socket, "TRIMS_SOCKET")
    settings = DaemonSettings(
        store_dir=Path(store_dir) if store_dir else data_dir(env),
        socket_path=Path(socket_path) if socket_path else default_socket(env),
        socket_mode=mode,
        socket_group=pick(args.socket_group, "TRIMS_SOCKET_GROUP"),
        budgets=TierBudgets(cpu=budgets["cpu"], disk=budgets["disk"], gpu=budgets["gpu"]),
        cpu_backing=pick(args.cpu_backing, "TRIMS_CPU_BACKING") or "auto",
        eviction=default_policy,
        s3_endpoint=pick(args.s3_endpoint, "TRIMS_S3_ENDPOINT"),
        otlp_endpoint=args.otlp_endpoint or otlp_endpoint_from_env(dict(env)),
        metrics_address=pick(args.metrics_address, "TRIMS_METRICS_ADDRESS"),
        crash_point=getattr(args, "crash_point", None),
        limits=build_limits(args, env),
        **_download_limits(args, env),
        **_memory_watermarks(args, env),
    )
    return settings, per_tier, log_level(args, env)


def run(args: argparse.Namespace) -> int:
    # Logging first: choosing the budgets logs how they were chosen.
    setup_logging(log_level(args, os.environ))
    settings, policies, _ = build_settings(args, os.environ)
    private_log()
    setup_tracing("trims-daemon", settings.otlp_endpoint)
    import uvloop

    return uvloop.run(serve(settings, policies))


#: Descriptors the daemon needs beside its connections: memfds, disk-tier files, catalog, logs.
_FD_HEADROOM = 1024


def raise_fd_limit(limits: ServerLimits) -> None:
    """Raise the soft RLIMIT_NOFILE so every connection slot can be used at once.

    Otherwise accept() fails with EMFILE before the connection limits apply (1024 is a common
    soft limit), and the admin socket, whose slots are reserved, could not accept either.
    """
    import resource

    need = limits.max_connections + limits.max_admin_connections + _FD_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < need:
            log.warning(
                "open-file limit is %d (hard); %d connection slots need about %d: lower "
                "--max-connections or raise the hard limit (ulimit -Hn)",
                hard,
                limits.max_connections + limits.max_admin_connections,
                need,
            )


async def serve(settings: DaemonSettings, policies: dict[str, str]) -> int:
    from trims.daemon.metrics import DaemonMetrics, MetricsServer
    from trims.daemon.server import Server
    from trims.daemon.store import Store
    from trims.daemon.tiers.gpu import open_gpu_tier

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    raise_fd_limit(settings.limits)
    metrics = DaemonMetrics()
    gpu = open_gpu_tier(settings.budgets.gpu)
    store = Store(settings, metrics, policies=policies, gpu=gpu)
    metrics_server: MetricsServer | None = None
    server = Server(settings, store, metrics)
    watch: asyncio.Task[None] | None = None
    try:
        store.start()
        watch = asyncio.create_task(store.res.watch_memory(), name="memory pressure")
        if settings.metrics_address:
            metrics_server = MetricsServer(metrics, settings.metrics_address)
        await server.start()
        extra = f" metrics={metrics_server.url}" if metrics_server else ""
        print(
            f"trims daemon ready socket={settings.socket_path}{extra}", file=sys.stderr, flush=True
        )
        log.info(
            "serving store %s on %s (admin %s)",
            settings.store_dir,
            settings.socket_path,
            settings.admin_socket_path,
        )
        await stop.wait()
        log.info("stopping: no new connections; closing clients and removing socket files")
    finally:
        if watch is not None:
            watch.cancel()
        await server.close()
        if metrics_server is not None:
            metrics_server.close()
        store.close()
    return 0
