"""The serverless benchmark's harness: one system in one memory cgroup, the trace replayed open
loop, what each request got, and the search for the largest rate the system sustains.

A system is anything that implements :class:`System` (trims in bench/serverless.py; a peer
adapter later, with or without a bench-side LRU controller: :meth:`System.admit` runs before
each request and :meth:`System.done` after it, which is where such a controller loads a model
on a miss and unloads the least recently used one without touching a model in flight).

Every process of the system runs inside one cgroup with the memory limit (:class:`Cgroup`):
its commands start behind :meth:`Cgroup.command_prefix`, which writes the shell's pid into
``cgroup.procs`` and execs the command, so the process and everything it forks are charged
there from their first page. The harness reads the cgroup's usage while the trace plays, and
its peak and OOM kills at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

MIB = 1 << 20
#: how often the cgroup's memory usage is sampled during a replay (seconds)
SAMPLE_S = 0.1
#: seconds the harness waits, after the last send, for requests in flight; those still
#: unanswered then count as "unanswered"
DRAIN_S = 30.0
#: seconds one request may take before the client gives up ("timeout")
CLIENT_TIMEOUT_S = 120.0
#: share of requests that must meet their SLO for a rate to be sustained
SLO_TARGET = 0.99


# ---- the memory cgroup ----------------------------------------------------------------------


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be made here (no controller mounted, or no permission)."""


@dataclass
class Cgroup:
    """One memory cgroup: v2 (``memory.max``) where the unified hierarchy has the memory
    controller, else v1 (``memory.limit_in_bytes`` under /sys/fs/cgroup/memory)."""

    path: Path
    version: int
    limit: int

    @classmethod
    def create(cls, name: str, limit: int, root: Path = Path("/sys/fs/cgroup")) -> Cgroup:
        """A new cgroup ``name`` limited to ``limit`` bytes, swap off. A leftover of the same
        name (a run that was killed) is emptied and made again."""
        v2 = root / "cgroup.controllers"
        if v2.exists() and "memory" in v2.read_text().split():
            group = cls(root / name, 2, limit)
        elif (root / "memory" / "memory.limit_in_bytes").exists():
            group = cls(root / "memory" / name, 1, limit)
        else:
            raise CgroupUnavailable(
                f"no memory cgroup controller under {root}: mount cgroup v2 with the memory "
                f"controller, or v1's at {root}/memory"
            )
        if group.path.exists():
            group.remove()
        try:
            group.path.mkdir()
            if group.version == 2:
                group._write("memory.max", str(limit))
                with contextlib.suppress(OSError):
                    group._write("memory.swap.max", "0")
            else:
                group._write("memory.limit_in_bytes", str(limit))
                with contextlib.suppress(OSError):
                    group._write("memory.swappiness", "0")
        except PermissionError as e:
            raise CgroupUnavailable(
                f"cannot create the cgroup {group.path} ({e}); run the benchmark as root"
            ) from e
        return group

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def command_prefix(self) -> list[str]:
        """Words to put before a command so that it runs in this cgroup: a shell writes its
        own pid into ``cgroup.procs``, then execs the command (same pid, from its first byte
        of memory on)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.procs_file)]

    def join(self) -> None:
        """Move the calling process here (a ``preexec_fn`` for :class:`subprocess.Popen`)."""
        self.procs_file.write_text(str(os.getpid()))

    def usage(self) -> int:
        return int(self._read("memory.current" if self.version == 2 else "memory.usage_in_bytes"))

    def working_set(self) -> int:
        """Usage less the inactive file cache (what cAdvisor and the kubelet call the working
        set): the memory the kernel could not simply drop when the limit is reached."""
        key = "inactive_file" if self.version == 2 else "total_inactive_file"
        for line in self._read("memory.stat").splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return max(0, self.usage() - int(value))
        return self.usage()

    def reset_peak(self) -> None:
        """Start the peak over (v1; v2's peak is taken from the samples)."""
        if self.version == 1:
            self._write("memory.max_usage_in_bytes", "0")

    def peak(self) -> int | None:
        """The kernel's peak since :meth:`reset_peak` (v1), None where it keeps none we can
        reset (v2)."""
        return int(self._read("memory.max_usage_in_bytes")) if self.version == 1 else None

    def oom_kills(self) -> int:
        text = self._read("memory.events" if self.version == 2 else "memory.oom_control")
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self._read("cgroup.procs").split()]
        except FileNotFoundError:
            return []

    def remove(self, timeout_s: float = 30.0) -> None:
        """SIGKILL what is left in it (every process here is the benchmark's), wait until it
        is empty, remove it."""
        deadline = time.monotonic() + timeout_s
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {pids} in {self.path} outlived SIGKILL")
            time.sleep(0.05)
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                # the last exits are still being accounted
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


@contextlib.contextmanager
def cgroup(name: str, limit: int) -> Iterator[Cgroup]:
    group = Cgroup.create(name, limit)
    try:
        yield group
    finally:
        group.remove()


def evict_page_cache(paths: Sequence[Path]) -> None:
    """Write back and drop the page cache of every file under ``paths`` (fdatasync, then
    ``POSIX_FADV_DONTNEED``): each system starts with its models on disk, and no system finds
    pages another one (or the benchmark that wrote the files) paid for."""
    for top in paths:
        files = [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file()]
        for path in files:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                with contextlib.suppress(OSError):
                    os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ---- the systems ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchModel:
    """One function and the model it serves: a ``peers_model.write_layers`` file of
    ``width``-wide square layers; a request is one [1, width] float32 row (V2 JSON)."""

    function: str
    name: str
    path: Path
    width: int
    bytes: int


class System(Protocol):
    """What the harness drives. One instance of a system is started, deployed, replayed
    against and stopped once per rate; :meth:`start` must put every process it starts into
    ``cgroup`` (:meth:`Cgroup.command_prefix` or :meth:`Cgroup.join`)."""

    #: the name ``--systems`` takes and the JSON's ``system`` field
    name: str

    def start(self, cgroup: Cgroup) -> None: ...

    async def deploy(self, session: Any, models: Sequence[BenchModel]) -> None:
        """Make every model's function servable (not necessarily loaded)."""

    def infer_url(self, function: str) -> str: ...

    async def admit(self, session: Any, function: str) -> None:
        """Runs before each request to ``function`` (and counts in its latency)."""

    def done(self, function: str) -> None:
        """Runs when a request to ``function`` has its answer (or failed)."""

    async def counters(self, session: Any) -> dict[str, Any]:
        """What the system reports about the run: ``cold_starts``, ``cold_start_mean_ms``
        where it reports them."""

    def stop(self) -> None: ...


class SystemBase:
    """The optional parts of :class:`System`: no admission step, no counters."""

    name = ""

    async def admit(self, session: Any, function: str) -> None:
        return None

    def done(self, function: str) -> None:
        return None

    async def counters(self, session: Any) -> dict[str, Any]:
        return {}


# ---- one replay -----------------------------------------------------------------------------


@dataclass
class Replay:
    """What one replay recorded: per request (function index, scheduled send time from the
    start, latency from that time or None, "ok" or the error kind), and the cgroup's usage
    and working set over time (seconds, bytes, bytes)."""

    outcomes: list[tuple[int, float, float | None, str]] = field(default_factory=list)
    memory: list[tuple[float, int, int]] = field(default_factory=list)
    seconds: float = 0.0
    send_lag_p99_ms: float | None = None


def error_kind(e: BaseException) -> str:
    """The kind a failed request is counted under (most specific first)."""
    import aiohttp

    table: tuple[tuple[type[BaseException], str], ...] = (
        (asyncio.TimeoutError, "timeout"),
        (aiohttp.ClientConnectorError, "connect refused"),
        (aiohttp.ServerDisconnectedError, "disconnected"),
        (aiohttp.ClientConnectionResetError, "disconnected"),
        (aiohttp.ClientOSError, "disconnected"),
        (aiohttp.ClientError, "client error"),
    )
    for kind, name in table:
        if isinstance(e, kind):
            return name
    return type(e).__name__


async def replay(
    system: System,
    session: Any,
    schedule: Sequence[tuple[float, int]],
    functions: Sequence[str],
    bodies: Sequence[bytes],
    group: Cgroup,
    drain_s: float = DRAIN_S,
) -> Replay:
    """Send ``schedule`` ((send time, function index), by time) open loop: each request at
    its time whether or not earlier ones were answered; its latency counts from that time,
    so queueing in the client shows too."""
    out = Replay()
    headers = {"Content-Type": "application/json"}
    start = time.perf_counter()
    lags: list[float] = []

    async def one(i: int, at: float) -> None:
        lags.append(time.perf_counter() - start - at)
        fn = functions[i]
        kind = "ok"
        try:
            await system.admit(session, fn)
            async with session.post(system.infer_url(fn), data=bodies[i], headers=headers) as r:
                await r.read()
                if r.status != 200:
                    kind = f"http {r.status}"
        except asyncio.CancelledError:
            out.outcomes.append((i, at, None, "unanswered"))
            raise
        except Exception as e:
            kind = error_kind(e)
        finally:
            system.done(fn)
        latency = time.perf_counter() - start - at
        out.outcomes.append((i, at, latency if kind == "ok" else None, kind))

    async def sample() -> None:
        while True:
            out.memory.append((time.perf_counter() - start, group.usage(), group.working_set()))
            await asyncio.sleep(SAMPLE_S)

    sampler = asyncio.create_task(sample(), name="cgroup memory sampler")
    tasks: set[asyncio.Task[None]] = set()
    try:
        for at, i in schedule:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(i, at))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            _, late = await asyncio.wait(set(tasks), timeout=drain_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    out.seconds = time.perf_counter() - start
    out.memory.append((out.seconds, group.usage(), group.working_set()))
    lags.sort()
    out.send_lag_p99_ms = lags[min(len(lags) - 1, int(len(lags) * 0.99))] * 1e3 if lags else None
    return out


# ---- measures -------------------------------------------------------------------------------


def percentile(ordered: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0-1, nearest rank) of sorted values; None for none."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def latency_stats(latencies: Sequence[float]) -> dict[str, float | None]:
    ordered = sorted(latencies)
    return {
        f"p{name}_ms": None if (v := percentile(ordered, q)) is None else v * 1e3
        for name, q in (("50", 0.5), ("99", 0.99), ("99.9", 0.999))
    }


def measure(
    run: Replay,
    slo_s: Sequence[float],
    head: frozenset[int],
    window_s: float,
    warmup_s: float = 0.0,
) -> dict[str, Any]:
    """The issue's measures of one replay, over the requests sent from ``warmup_s`` on (a
    system starts empty; one in service has its busy functions' instances up): SLO
    attainment (a request meets its SLO when it was answered 200 within its function's
    ``slo_s``), goodput (SLO-meeting requests per second of the measured window), head and
    tail latency percentiles of the answered requests, errors by kind."""
    outcomes = [o for o in run.outcomes if o[1] >= warmup_s]
    n = len(outcomes)
    met = sum(1 for i, _, lat, _ in outcomes if lat is not None and lat <= slo_s[i])
    errors: dict[str, int] = {}
    for _, _, _, kind in outcomes:
        if kind != "ok":
            errors[kind] = errors.get(kind, 0) + 1
    head_lat = [lat for i, _, lat, _ in outcomes if lat is not None and i in head]
    tail_lat = [lat for i, _, lat, _ in outcomes if lat is not None and i not in head]
    every = sorted(lat for _, _, lat, _ in outcomes if lat is not None)
    cdf = [round(v * 1e3, 3) for q in range(101) if (v := percentile(every, q / 100)) is not None]
    measured_s = window_s - warmup_s
    return {
        "requests": n,
        "warmup_requests": len(run.outcomes) - n,
        "answered": len(every),
        "slo_met": met,
        "slo_attainment": met / n if n else None,
        "goodput_rps": met / measured_s if measured_s > 0 else 0.0,
        "head": latency_stats(head_lat),
        "tail": latency_stats(tail_lat),
        "errors": dict(sorted(errors.items())),
        "latency_cdf_ms": cdf,
        "send_lag_p99_ms": run.send_lag_p99_ms,
    }


# ---- the sustainable rate -------------------------------------------------------------------


async def search(
    run_at: Callable[[float], Awaitable[dict[str, Any]]],
    start: float,
    max_runs: int,
    target: float = SLO_TARGET,
    resolution: float = 0.1,
) -> tuple[list[dict[str, Any]], float | None]:
    """The largest rate scale at which ``run_at(scale)["slo_attainment"] >= target``: double
    from ``start`` while it holds (halve while it does not), then bisect between the highest
    scale that held and the lowest that did not, until they are within ``resolution`` of each
    other (relative) or ``max_runs`` runs are spent. Returns every run (in order) and the
    scale found (None: none held)."""
    runs: list[dict[str, Any]] = []
    held: float | None = None
    failed: float | None = None
    scale = start
    for _ in range(max_runs):
        r = await run_at(scale)
        runs.append(r)
        if (r.get("slo_attainment") or 0.0) >= target:
            held = scale if held is None else max(held, scale)
        else:
            failed = scale if failed is None else min(failed, scale)
        if failed is None:
            assert held is not None
            scale = held * 2
        elif held is None:
            scale = failed / 2
        elif failed / held <= 1 + resolution:
            break
        else:
            scale = (held + failed) / 2
    return runs, held
