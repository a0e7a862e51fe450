"""Helpers shared by the benchmark scripts: processes they start, and how results are written."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from trims import daemon_process
from trims.daemon_process import Started, launch, without_trims_env
from trims.timing import summarize

REPO = Path(__file__).resolve().parent.parent


#: seconds a child gets to exit after SIGTERM before SIGKILL
STOP_GRACE_S = 60.0


def start(
    cmd: Sequence[str], log: Path, ready: str, timeout_s: float = 120.0, prefix: Sequence[str] = ()
) -> Started:
    """A child whose log (appended) matched ``ready``; configured by its command line only
    (no ``TRIMS_*`` variables). ``prefix`` runs first and execs the command (a benchmark's
    cgroup join: bench/serverless_harness.py ``Cgroup.command_prefix``)."""
    return launch([*prefix, *cmd], log, ready, timeout_s=timeout_s, env=without_trims_env(),
                  stop_grace_s=STOP_GRACE_S)  # fmt: skip


def start_daemon(
    root: Path,
    cpu_budget: str | None = "8GiB",
    timeout_s: float = 120.0,
    prefix: Sequence[str] = (),
    **options: str,
) -> tuple[Started, Path]:
    """A daemon storing under ``root``, logging to ``root/daemon.log``; ``options`` become
    flags (``gpu_budget="8GiB"`` -> ``--gpu-budget 8GiB``); ``cpu_budget=None`` leaves the
    daemon's own default; ``prefix`` as for :func:`start`."""
    socket_path = root / "run" / "store.sock"
    flags = {**({} if cpu_budget is None else {"cpu_budget": cpu_budget}), **options}
    if prefix:
        socket_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = daemon_process.daemon_command(socket_path, store_dir=root / "store", options=flags)
        daemon = launch([*prefix, *cmd], root / "daemon.log", daemon_process.DAEMON_READY,
                        timeout_s=timeout_s, env=without_trims_env(), name="the store daemon",
                        stop_grace_s=STOP_GRACE_S)  # fmt: skip
        return daemon, socket_path
    daemon = daemon_process.start_daemon(
        socket_path, store_dir=root / "store", log=root / "daemon.log",
        options=flags, timeout_s=timeout_s,
        env=without_trims_env(), stop_grace_s=STOP_GRACE_S,
    )  # fmt: skip
    return daemon, socket_path


def start_gateway(root: Path, *args: str, prefix: Sequence[str] = ()) -> tuple[Started, str]:
    cmd = [sys.executable, "-m", "trims", "gateway", "--port", "0", "--no-auth", *args]
    proc = start(cmd, root / "gateway.log", r"trims gateway ready url=(\S+)", prefix=prefix)
    return proc, proc.match.group(1)


def summary(samples: Sequence[float]) -> dict[str, float]:
    """Median, min and max seconds (:func:`trims.timing.summarize`)."""
    s = summarize(samples)
    return {"median_s": s.median_s, "min_s": s.min_s, "max_s": s.max_s}


def write_json(path: Path | None, doc: dict[str, Any]) -> None:
    text = json.dumps(doc, indent=2)
    if path is None:
        print(text)
        return
    from trims.config import write_atomic

    write_atomic(path, text + "\n")


def write_report(path: Path | None, doc: dict[str, Any], text: str) -> None:
    """The JSON at ``path`` and its markdown ``text`` beside it (``.md``), each written
    atomically, then ``text`` on stdout; without ``path`` the JSON goes to stdout too."""
    write_outputs(path, None if path is None else path.with_suffix(".md"), doc, text)


def write_outputs(
    json_path: Path | None, markdown: Path | None, doc: dict[str, Any], text: str
) -> None:
    """The JSON at ``json_path`` (stdout without one), the markdown ``text`` at ``markdown``
    when given, each written atomically; then ``text`` on stdout."""
    write_json(json_path, doc)
    if markdown is not None:
        from trims.config import write_atomic

        write_atomic(markdown, text)
    print(text)


def machine() -> str:
    cpus = os.cpu_count()
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return f"{cpus} CPUs, load average {load:.1f} at start"


#: Executors the benchmarks' in-process gateway offers (spec "executor" field -> options).
EXECUTORS: dict[str, dict[str, Any]] = {
    "local": {"zygote": True, "store": True},
    "spawn-store": {"zygote": False, "store": True},
    "spawn-direct": {"zygote": False, "store": False},
    "zygote-direct": {"zygote": True, "store": False},
    # containers from the runtime image (dockerfiles/build-image.sh), the daemon's socket mounted
    "docker": {"store": True, "image": "trims-runtime:latest"},
}


@contextlib.asynccontextmanager
async def local_gateway(root: Path, store_socket: Path) -> AsyncIterator[str]:
    """A gateway in this process (its URL) whose functions pick one of ``EXECUTORS``.

    "-direct" executors point workers at a socket where no daemon listens, so their models
    load from the spec's ``source`` file in each instance.
    """
    from aiohttp import web

    from trims.runtime.executors import create_executor
    from trims.runtime.gateway.app import create_app
    from trims.runtime.settings import GatewaySettings

    def make(name: str) -> object:
        opts = EXECUTORS[name]
        socket_path = store_socket if opts["store"] else root / "no-store.sock"
        if "image" in opts:
            return create_executor(
                "docker", image=opts["image"], store_socket=socket_path,
                state_dir=root / "instances" / name,
            )  # fmt: skip
        return create_executor(
            "local", zygote=opts["zygote"], store_socket=socket_path,
            state_dir=root / "instances" / name,
        )  # fmt: skip

    settings = GatewaySettings(port=0, store_socket=store_socket, drain_timeout_s=5, auth=False)
    runner = web.AppRunner(create_app(settings, make), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def write_model(path: Path, megabytes: int, seed: float = 0.0, tensor_mb: int = 50) -> None:
    """A safetensors file of ``megabytes`` MiB of float32 tensors (at most ``tensor_mb`` each)."""
    import numpy as np
    from safetensors.numpy import save_file

    tensors = {}
    left = megabytes << 20
    i = 0
    while left > 0:
        n = min(left, tensor_mb << 20) // 4
        tensors[f"layer{i:03d}.weight"] = np.full(n, seed + i, dtype=np.float32)
        left -= n * 4
        i += 1
    save_file(tensors, str(path))
    path.chmod(0o644)  # safetensors writes 0600; workers (nobody) load sources themselves


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def pss_bytes(pid: int) -> int:
    """Proportional set size of a process (shared pages divided among their mappers)."""
    return int(psutil.Process(pid).memory_full_info().pss)


def tree_pids(root: int) -> list[int]:
    """``root`` and all its live descendants."""
    return [root, *(c.pid for c in psutil.Process(root).children(recursive=True))]


def cpu_seconds(pids: Sequence[int]) -> dict[int, float]:
    """User + system CPU seconds used so far by each process still there."""
    out = {}
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        out[pid] = times.user + times.system
    return out


def drop_caches() -> str | None:
    """Write back dirty pages and drop the page cache, dentries and inodes (``echo 3 >
    /proc/sys/vm/drop_caches``); why it could not, or None."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        return f"cannot drop caches ({e}); run as root on a host whose /proc/sys is writable"
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (for servers that cannot bind port 0)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_metric(text: str, name: str, labels: dict[str, str]) -> float | None:
    """The value of sample ``name{labels...}`` in Prometheus text, or None."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head == name:
            found: set[str] = set()
        elif head.startswith(name + "{") and head.endswith("}"):
            found = set(head[len(name) + 1 : -1].split(","))
        else:
            continue
        if want <= found:
            return float(value)
    return None


def latency_summary(latencies: Sequence[float], seconds: float, errors: int) -> dict[str, Any]:
    """Requests/s over ``seconds``, p50 and p99 in ms of ``latencies`` (seconds)."""
    ordered = sorted(latencies)
    n = len(ordered)
    return {
        "requests": n,
        "errors": errors,
        "rps": n / seconds if seconds > 0 else 0.0,
        "p50_ms": ordered[n // 2] * 1e3 if n else None,
        "p99_ms": ordered[min(n - 1, int(n * 0.99))] * 1e3 if n else None,
    }


async def closed_loop(
    send: Callable[[], Awaitable[bool]], concurrency: int, seconds: float, warmup_s: float = 1.0
) -> dict[str, Any]:
    """``concurrency`` clients each sending the next request when the last one is answered;
    ``send`` returns whether the answer was right. Measured after ``warmup_s``."""
    import asyncio
    import time

    latencies: list[float] = []
    errors = 0
    start = time.perf_counter() + warmup_s
    stop_at = start + seconds

    async def client() -> None:
        nonlocal errors
        while (t0 := time.perf_counter()) < stop_at:
            ok = await send()
            if t0 >= start:
                if ok:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latency_summary(latencies, seconds, errors)


#: Seconds an open loop waits, after its last scheduled request, for the ones in flight; those
#: still unanswered then count as errors.
OPEN_DRAIN_S = 10.0


async def open_loop(
    send: Callable[[], Awaitable[bool]], rate: float, seconds: float, warmup_s: float = 1.0
) -> dict[str, Any]:
    """Requests sent at ``rate`` per second on a fixed schedule whether or not earlier ones
    were answered; each latency counts from its scheduled send time, so queueing shows (a
    closed loop hides it: coordinated omission). ``send_lag_p99_ms`` says how late the
    generator itself sent (near its own capacity it cannot keep the schedule)."""
    import asyncio
    import time

    latencies: list[float] = []
    lags: list[float] = []
    errors = 0
    start = time.perf_counter()
    measure_from = start + warmup_s
    stop_at = measure_from + seconds

    async def one(scheduled: float) -> None:
        nonlocal errors
        measured = scheduled >= measure_from
        if measured:
            lags.append(time.perf_counter() - scheduled)
        ok = await send()
        if measured:
            if ok:
                latencies.append(time.perf_counter() - scheduled)
            else:
                errors += 1

    tasks: set[asyncio.Task[None]] = set()
    sent = 0
    while (scheduled := start + sent / rate) < stop_at:
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(scheduled))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        sent += 1
    if tasks:
        _, late = await asyncio.wait(tasks, timeout=OPEN_DRAIN_S)
        for task in late:
            task.cancel()
        errors += len(late)
    lags.sort()
    out = latency_summary(latencies, seconds, errors)
    out["rate"] = out["offered_rps"] = rate
    out["send_lag_p99_ms"] = lags[min(len(lags) - 1, int(len(lags) * 0.99))] * 1e3 if lags else None
    return out


def size_run_options(parser: argparse.ArgumentParser, mb_help: str) -> None:
    """The options of a benchmark over one model size: ``--mb`` (default 512), ``--runs``
    (default 5), ``--quick`` (64 MiB, 2 runs, labelled), ``--json``, ``--markdown``."""
    parser.add_argument("--mb", type=int, default=512, help=mb_help)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="64 MiB, 2 runs: checks it works")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)


def check_size_run_options(
    parser: argparse.ArgumentParser, args: argparse.Namespace, min_mb: int = 1
) -> None:
    """Refuse a ``--runs`` below 1 or an ``--mb`` below ``min_mb``; apply ``--quick``."""
    if args.runs < 1 or args.mb < min_mb:
        parser.error(f"--runs must be at least 1 and --mb at least {min_mb}")
    if args.quick:
        args.mb, args.runs = min(args.mb, 64), min(args.runs, 2)
