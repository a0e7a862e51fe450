"""trims against the servers a user would pick instead, side by side: MLServer, KServe, Ray
Serve, Triton (PyTriton) and TorchServe. Cold start to the first full response, memory of N
replicas, warm throughput and tail latency, on the same models and the same forward pass.

    python bench/peers.py --setup [--systems ...]   # each peer's venv (once; idempotent)
    python bench/peers.py [--runs 3] [--systems trims,mlserver,kserve,ray,triton,torchserve]
                          [--json OUT.json] [--markdown OUT.md] [--figure docs/img/peers.png]
    python bench/peers.py --quick            # 2 runs, 128 MiB model, short loads: a check

Every system serves the same models (``peers_mlserver/peers_model.py``): ``full``,
``--model-mb`` MiB of Linear(4096, 4096) float32 layers (512 MiB = 8 layers), and a small MLP
(64-256-256-10) for throughput, each a safetensors file opened with mmap (no copy); the same
request, a [1, 4096] (or [1, 64]) float32 ``input``, as V2 (Open Inference Protocol) JSON where
the system speaks V2 and as the same JSON to its own route otherwise (Ray Serve); and the same
torch forward pass over every weight. Each peer is one ``bench/peer_<name>.py`` (its pinned
packages, its configuration for CPU serving as its docs recommend: the report prints it) and
runs in its own venv (``$TRIMS_<NAME>_VENV``, default ``/tmp/trims-<name>-venv``). A peer that
cannot run here is reported with its exact error, not dropped.

Cases (JSON names in brackets), every system alone on the machine while it is measured, in an
order that changes run by run (:func:`order`: rotated and reversed every other run, so no
system always follows another: a case measured right after another system's work starts
slower), each cold case with the page cache warm and dropped right before (``echo 3 >
/proc/sys/vm/drop_caches``), every warm run first (a drop evicts the library code no live
process has mapped, and a warm case right after another system's dropped one met a cache that
was cold for it):

* cold start (``cold_start``): trims ``scale_from_zero`` (a function with no instance, its
  model in the CPU tier, ``tier: cpu``, or evicted to the disk tier, ``tier: disk``) and
  ``standby`` (a prepared standby: only ``init`` runs); a peer's ``load`` (its API loading a
  model into a server that runs, where it has one) and ``process_start`` (the server started
  with the model). ``first_response_ms`` ends at the first full response, ``warm_ms`` is the
  next request and ``overhead_ms`` the median per run of (first - warm).
* memory (``memory``): total PSS of ``--replicas`` replicas of ``full``, each having run a
  forward pass.
* throughput (``throughput``) on the small model with one replica per core: closed loops at
  c=1 and c=16 (p50/p99, req/s), the V2 binary tensor request at c=16 where the system takes it
  (``closed-binary``), and an open loop at 80% of the best system's c=16 rate, the same offered
  rate for all (p99 at that rate).

Note [idle memory]
~~~~~~~~~~~~~~~~~~
On some nodes memory that sat unread for a while is slower to read again (this 2-core VM:
a forward pass over 512 MiB took 1.6x its warm time after 1 s unread, 2.9x after 4 s;
``bench/idle_memory.py`` measures a node without trims). A first request reads weights that
sat unread since the case before, the warm request right after it reads them hot, so on such
a node first / warm measures the idle time as much as the cold start. For trims' cases a third
request to the same instance therefore waits first as long as the weights had sat unread
before the first one (``idle_ms``, counted from the benchmark's last full read or load of
them, at most ``IDLE_CAP_S``) and is timed as ``warm_idle_ms``: the warm request to hold the
first one against. Not for the disk tier with caches dropped, whose first request reads
weights fresh from disk.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers_mlserver"))

from peer_base import Infer, ModelFile, Peer, PeerServer, v2_binary_request, v2_json_request
from peers_model import MLP_SIZES, WIDTH, write_layers
from peers_report import render_markdown, write_figure
from peers_trims import ColdRun, Trims, prepare_cache, trims_cold
from runtime_common import (
    closed_loop,
    drop_caches,
    machine,
    open_loop,
    pss_bytes,
    summary,
    write_outputs,
)

SECTIONS = ("cold", "memory", "throughput")
PEERS = ("mlserver", "kserve", "ray", "triton", "torchserve")
SYSTEMS = ("trims", *PEERS)
#: requests one trims instance takes at once in the throughput runs (scaling.concurrency)
THROUGHPUT_CONCURRENCY = 2
TRIMS_CONFIGURATION = (
    "a daemon (both models in its CPU tier) and a gateway (zygote executor, --warm-pool "
    "{warm_pool}); each model a function; N replicas = N instances, each with resources.cpus = "
    "cores / N (its torch threads, as Ray's num_cpus) and, for throughput, scaling.concurrency "
    "{concurrency}; OMP_WAIT_POLICY=PASSIVE (its default); "
    "V2 JSON and binary on the gateway's fast path"
)


def peer(name: str) -> Peer:
    """The peer of ``bench/peer_<name>.py``."""
    cls: type[Peer] = importlib.import_module(f"peer_{name}").PEER
    return cls()


def setup(names: Sequence[str]) -> int:
    """Install every named peer; each failure is printed with its exact error."""
    failed = 0
    for name in names:
        t0 = time.perf_counter()
        try:
            peer(name).setup()
        except Exception as e:  # each peer's own error, printed whole
            print(f"error: {name}: {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"{name} ready ({time.perf_counter() - t0:.0f} s)")
    return 1 if failed else 0


def share(replicas: int) -> float:
    """Each of ``replicas`` trims instances' share of the cores (``resources.cpus``: its torch
    threads), as Ray's adapter gives each replica ``num_cpus`` and Triton's its intra-op
    threads; one replica has them all."""
    return max(1, os.cpu_count() or 1) / max(1, replicas)


def order(systems: Sequence[str], run: int) -> list[str]:
    """The systems in run ``run``'s order: rotated by ``run``, reversed every other run."""
    k = run % len(systems)
    rotated = [*systems[k:], *systems[:k]]
    return rotated[::-1] if run % 2 else rotated


class Failures:
    """Peers that failed during the runs: each keeps its error and runs no further case."""

    def __init__(self) -> None:
        self.errors: dict[str, str] = {}

    @contextlib.contextmanager
    def guard(self, system: str, section: str) -> Iterator[None]:
        try:
            yield
        except Exception as e:  # a peer's failure is a result to report, not a crash
            self.errors.setdefault(system, f"{section}: {type(e).__name__}: {e}")
            print(f"{system} failed in {section}: {e}", file=sys.stderr)

    def ok(self, system: str) -> bool:
        return system not in self.errors


# ---- cold start -----------------------------------------------------------------------------

#: cold runs by (system, case, tier, page cache)
ColdRuns = dict[tuple[str, str, str | None, str], list[ColdRun]]


async def _trims_cold_cases(
    session: Any, trims: Trims, width: int, cache: str, run: int, runs: ColdRuns
) -> None:
    """trims' cases of one run: scale from zero (CPU and disk tier), a standby (CPU tier)."""
    for tier, standby in (("cpu", False), ("cpu", True), ("disk", False)):
        case = "standby" if standby else "scale_from_zero"
        name = f"full-{tier}-{cache}-{run}{'-sb' if standby else ''}"
        r = await trims_cold(session, trims, name, width, tier, cache, standby)
        runs.setdefault(("trims", case, tier, cache), []).append(r)
        log_run("trims", f"{case}/{tier}", cache, run, r)


async def _first_and_warm(infer: Infer, t0: float) -> ColdRun:
    """The first full response (timed from ``t0``) and the warm one after it, from one pid."""
    pid = await infer.pid()
    first = time.perf_counter() - t0
    t1 = time.perf_counter()
    if await infer.pid() != pid:
        raise RuntimeError("the warm request met another replica than the first one")
    return ColdRun(first, time.perf_counter() - t1)


async def peer_load(
    session: Any, p: Peer, root: Path, full: ModelFile, width: int, cache: str
) -> ColdRun:
    """First and warm response after the peer's load API loads ``full`` into a server that
    runs and has loaded (and unloaded) it once, untimed: its first load imports torch."""
    server = p.start(root, [full], workers=0, loaded=False)
    try:
        await p.live(session, server)
        infer = server.infer(session, full.name, width)
        assert infer is not None
        await server.load(session, full.name)
        await infer.pid()
        await server.unload(session, full.name)
        prepare_cache(cache)
        t0 = time.perf_counter()
        await server.load(session, full.name)
        return await _first_and_warm(infer, t0)
    finally:
        server.stop()


async def peer_process_start(
    session: Any, p: Peer, root: Path, full: ModelFile, width: int, cache: str
) -> ColdRun:
    """First and warm response of a new server process started with ``full``."""
    prepare_cache(cache)
    t0 = time.perf_counter()
    server = p.start(root, [full], workers=0)
    try:
        infer = server.infer(session, full.name, width)
        assert infer is not None
        await server.wait(session, infer.pid)
        first = time.perf_counter() - t0
        t1 = time.perf_counter()
        await infer.pid()
        return ColdRun(first, time.perf_counter() - t1)
    finally:
        server.stop()


async def cold(
    session: Any,
    trims: Trims | None,
    peers: dict[str, Peer],
    root: Path,
    full: Path,
    args: argparse.Namespace,
    caches: list[str],
    failures: Failures,
) -> list[dict[str, Any]]:
    runs: ColdRuns = {}
    model = ModelFile("full", full, False)
    systems = [s for s in args.systems if s == "trims" or s in peers]
    for cache in caches:  # every warm-cache run before the dropped ones: see the docstring
        for run in range(args.runs):
            for system in order(systems, run):
                if system == "trims":
                    assert trims is not None
                    await _trims_cold_cases(session, trims, args.width, cache, run, runs)
                    continue
                p = peers[system]
                cases = (("load", peer_load),) if p.load_api else ()
                for case, measure in (*cases, ("process_start", peer_process_start)):
                    if not failures.ok(system):
                        break
                    with failures.guard(system, f"cold {case}"):
                        r = await measure(session, p, root, model, args.width, cache)
                        runs.setdefault((system, case, None, cache), []).append(r)
                        log_run(system, case, cache, run, r)
    return [cold_row(key, rs) for key, rs in runs.items()]


def _median_ms(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) * 1e3 if known else None


def cold_row(key: tuple[str, str, str | None, str], runs: list[ColdRun]) -> dict[str, Any]:
    system, case, tier, cache = key
    s = summary([r.first for r in runs])
    started = [r for r in runs if r.start_ms is not None]
    starts = [r.start_ms for r in started]
    requests = [r.first * 1e3 - (r.start_ms or 0.0) for r in started]
    ratios = [(r.first * 1e3 - (r.start_ms or 0.0)) / (r.warm * 1e3) for r in started]
    return {
        "system": system,
        "case": case,
        "cache": cache,
        "tier": tier,
        "first_response_ms": s["median_s"] * 1e3,
        "warm_ms": statistics.median(r.warm for r in runs) * 1e3,
        "overhead_ms": statistics.median(r.first - r.warm for r in runs) * 1e3,
        "min_ms": s["min_s"] * 1e3,
        "max_ms": s["max_s"] * 1e3,
        "runs": len(runs),
        # trims: the gateway's own measure of the instance start, the first request alone
        # (first response less it), and the median per run of that over the warm request
        "instance_start_ms": statistics.median(starts) if starts else None,
        "first_request_ms": statistics.median(requests) if requests else None,
        "first_request_ratio": statistics.median(ratios) if ratios else None,
        # the warm request after the same idle as the first one (Note [idle memory])
        "warm_idle_ms": _median_ms([r.warm_idle for r in runs]),
        "idle_ms": _median_ms([r.idle for r in runs]),
    }


def log_run(system: str, case: str, cache: str, run: int, r: ColdRun) -> None:
    idle = (
        ""
        if r.warm_idle is None or r.idle is None
        else f", warm after {r.idle * 1e3:.0f} ms idle {r.warm_idle * 1e3:7.1f} ms"
    )
    print(
        f"{system:>10} {case:>22} cache {cache:<7} run {run}: first {r.first * 1e3:8.1f} ms, "
        f"warm {r.warm * 1e3:7.1f} ms{idle}",
        file=sys.stderr,
    )


# ---- memory ---------------------------------------------------------------------------------


async def replicas_ran(infer: Infer, n: int, processes: bool = True) -> set[int]:
    """Concurrent full forward passes until ``n`` different processes answered (each of them
    has then read every weight); for replicas inside one process, 8 rounds of ``n``. Each
    request on a new connection: a server whose processes share one listening socket (KServe,
    uvicorn workers) balances connections, not requests."""
    import aiohttp

    seen: set[int] = set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as fresh:
        each = Infer(fresh, infer.url, infer.request, infer.answer_pid)
        for _ in range(50 if processes else 8):
            seen |= set(await asyncio.gather(*(each.pid() for _ in range(n))))
            if processes and len(seen) >= n:
                return seen
    if processes:
        raise RuntimeError(f"only {len(seen)} of {n} replicas answered after 50 rounds")
    return seen


def total_pss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += pss_bytes(pid)
        except Exception:  # a process that ended meanwhile holds nothing
            continue
    return total / 2**20


async def memory(
    session: Any,
    trims: Trims | None,
    peers: dict[str, Peer],
    root: Path,
    full: Path,
    args: argparse.Namespace,
    failures: Failures,
) -> list[dict[str, Any]]:
    """Total PSS of each system with ``args.replicas`` replicas of ``full``, each having run
    a full forward pass (so each has mapped every weight)."""
    n = args.replicas
    pss: dict[str, float] = {}
    if trims is not None:
        spec = trims.spec(
            "full-replicas", "full", args.width, share(n), min_instances=n, max_instances=n
        )
        url = await trims.deploy(session, spec)
        pids = await replicas_ran(Infer(session, url, v2_json_request(args.width)), n)
        pss["trims"] = total_pss_mib(trims.pids())
        await trims.delete(session, "full-replicas", pids)
    for name, p in peers.items():
        if not failures.ok(name):
            continue
        with failures.guard(name, "memory"):
            server = p.start(root, [ModelFile("full", full, False)], workers=n)
            try:
                infer = server.infer(session, "full", args.width)
                assert infer is not None
                await server.wait(session, infer.pid)
                await replicas_ran(infer, n, p.process_replicas)
                pss[name] = total_pss_mib(server.pids())
            finally:
                server.stop()
    model_mib = full.stat().st_size / 2**20
    for system, mib in pss.items():
        print(f"memory, {n} replicas: {system} {mib:.0f} MiB", file=sys.stderr)
    return [
        {"system": s, "replicas": n, "pss_mib": p, "model_mib": model_mib} for s, p in pss.items()
    ]


# ---- throughput -----------------------------------------------------------------------------


class Side:
    """One system serving the small model for the throughput runs (started per run, so each
    system is alone on the machine while it is measured)."""

    def __init__(self, system: str, trims: Trims | None, p: Peer | None) -> None:
        self.system, self.trims, self.peer = system, trims, p
        self.server: PeerServer | None = None
        self.url = ""

    async def start(self, session: Any, root: Path, mlp: Path, workers: int) -> None:
        if self.trims is not None:
            if not self.url:
                # two requests in flight per instance: the next one waits in the worker
                # while the current one runs, instead of a round trip through the gateway
                # after it (+20% at c=16 with 2 instances on 2 cores: 1609-1686 -> 1948-2023)
                spec = self.trims.spec(
                    "mlp", "mlp", MLP_SIZES[0], share(workers),
                    min_instances=workers, max_instances=workers,
                    concurrency=THROUGHPUT_CONCURRENCY,
                )  # fmt: skip
                self.url = await self.trims.deploy(session, spec)
            return
        assert self.peer is not None
        self.server = self.peer.start(root, [ModelFile("mlp", mlp, True)], workers=workers)
        infer = self.server.infer(session, "mlp", MLP_SIZES[0])
        assert infer is not None
        await self.server.wait(session, infer.pid)

    def infer(self, session: Any, binary: bool) -> Infer | None:
        width = MLP_SIZES[0]
        if self.server is None:
            request = v2_binary_request(width) if binary else v2_json_request(width)
            return Infer(session, self.url, request)
        return self.server.infer(session, "mlp", width, binary)

    def processes(self) -> bool:
        return self.peer is None or self.peer.process_replicas

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@contextlib.asynccontextmanager
async def running(
    session: Any, root: Path, mlp: Path, side: Side, workers: int
) -> AsyncIterator[None]:
    """``side`` started, every replica warm; stopped on the way out."""
    await side.start(session, root, mlp, workers)
    try:
        infer = side.infer(session, binary=False)
        assert infer is not None
        await replicas_ran(infer, workers, side.processes())
        yield
    finally:
        side.stop()


async def throughput(
    session: Any,
    trims: Trims | None,
    peers: dict[str, Peer],
    root: Path,
    mlp: Path,
    args: argparse.Namespace,
    failures: Failures,
) -> list[dict[str, Any]]:
    n = args.workers
    sides = {s: Side(s, trims if s == "trims" else None, peers.get(s)) for s in args.systems}
    sides = {s: side for s, side in sides.items() if s == "trims" or s in peers}
    samples: dict[tuple[str, str, int | None], list[dict[str, Any]]] = {}

    def log(system: str, mode: str, label: str, run: int, r: dict[str, Any]) -> None:
        p99 = "-" if r["p99_ms"] is None else f"{r['p99_ms']:.2f}"
        print(
            f"{system:>10} {mode} {label} run {run}: {r['rps']:.0f} req/s, p99 {p99} ms, "
            f"{r['errors']} errors",
            file=sys.stderr,
        )

    async def loop(
        system: str, infer: Infer, mode: str, c: int | None, rate: float, run: int
    ) -> None:
        infer.failures = {}
        if mode == "open":
            r = await open_loop(infer.ok, rate, args.seconds)
        else:
            r = await closed_loop(infer.ok, c or 1, args.seconds)
        r["statuses"] = infer.failures
        r["request"] = infer.request.format
        samples.setdefault((system, mode, c), []).append(r)
        log(system, mode, f"c={c}" if c else f"{rate:.0f}/s", run, r)

    for run in range(args.runs):  # closed loops first: the open loop's rate comes from them
        for system in order(list(sides), run):
            if not failures.ok(system):
                continue
            with failures.guard(system, "throughput"):
                side = sides[system]
                async with running(session, root, mlp, side, n):
                    plain = side.infer(session, binary=False)
                    assert plain is not None
                    for c in (1, 16):
                        await loop(system, plain, "closed", c, 0.0, run)
                    binary = side.infer(session, binary=True)
                    if binary is not None:
                        await loop(system, binary, "closed-binary", 16, 0.0, run)
    best = [
        statistics.median(s["rps"] for s in rs)
        for (system, mode, c), rs in samples.items()
        if mode == "closed" and c == 16 and failures.ok(system)
    ]
    rate = 0.8 * max(best) if best else 0.0
    for run in range(args.runs if rate > 0 else 0):
        for system in order(list(sides), run):
            if not failures.ok(system):
                continue
            with failures.guard(system, "open loop"):
                side = sides[system]
                async with running(session, root, mlp, side, n):
                    plain = side.infer(session, binary=False)
                    assert plain is not None
                    await loop(system, plain, "open", None, rate, run)

    def med(rs: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in rs if r.get(key) is not None]
        return statistics.median(values) if values else None

    return [
        {
            "system": system,
            "mode": mode,
            "request": rs[0]["request"],
            "concurrency": c,
            "rate": med(rs, "rate") if mode == "open" else None,
            "rps": med(rs, "rps"),
            "p50_ms": med(rs, "p50_ms"),
            "p99_ms": med(rs, "p99_ms"),
            "errors": sum(r["errors"] for r in rs),
            "error_statuses": merged_statuses(rs),
            "runs": len(rs),
        }
        for (system, mode, c), rs in samples.items()
        if failures.ok(system)
    ]


def merged_statuses(results: list[dict[str, Any]]) -> dict[str, int]:
    """HTTP status -> count of the non-200 answers over ``results`` (JSON keys are text)."""
    out: dict[str, int] = {}
    for r in results:
        for status, count in r["statuses"].items():
            out[str(status)] = out.get(str(status), 0) + count
    return out


# ---- the run --------------------------------------------------------------------------------


async def run_all(
    root: Path, args: argparse.Namespace, only: list[str], peers: dict[str, Peer]
) -> dict[str, Any]:
    import aiohttp

    full, mlp = root / "full.safetensors", root / "mlp.safetensors"
    write_layers(full, (args.width,) * (layers(args) + 1))
    write_layers(mlp, MLP_SIZES)
    caches = ["warm"] if args.keep_page_cache else ["warm", "dropped"]
    doc: dict[str, Any] = {"cold_start": [], "memory": [], "throughput": [], "notes": []}
    if "dropped" in caches and "cold" in only and (why := drop_caches()):
        caches.remove("dropped")
        doc["notes"].append(f"the dropped-cache cases were skipped: {why}")
    trims = None
    if "trims" in args.systems:
        trims = Trims(root, {"full": full, "mlp": mlp}, args.warm_pool)
    failures = Failures()
    # Idle connections are closed here before a server closes them (uvicorn after 5 s): a
    # request sent on one the server was closing failed with "Server disconnected".
    connector = aiohttp.TCPConnector(limit=1024, keepalive_timeout=2.0)
    timeout = aiohttp.ClientTimeout(total=600)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            if "cold" in only:
                doc["cold_start"] = await cold(
                    session, trims, peers, root, full, args, caches, failures
                )
            if "memory" in only:
                doc["memory"] = await memory(session, trims, peers, root, full, args, failures)
            if "throughput" in only:
                doc["throughput"] = await throughput(
                    session, trims, peers, root, mlp, args, failures
                )
    finally:
        if trims is not None:
            trims.stop()
    doc["failed"] = failures.errors
    return doc


def layers(args: argparse.Namespace) -> int:
    """Linear(width, width) float32 layers in ``--model-mb`` MiB (at least one)."""
    return max(1, (args.model_mb << 20) // (args.width * args.width * 4))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--setup", action="store_true", help="install the peers' venvs and exit")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model-mb", type=int, default=512, help="size of the full model")
    parser.add_argument(
        "--width", type=int, default=WIDTH, help="of its square layers (4096: 64 MiB a layer)"
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument(
        "--workers",
        "--mlserver-workers",
        type=int,
        default=os.cpu_count() or 1,
        help="replicas of every system for the throughput runs (default: one per core)",
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="per throughput run")
    parser.add_argument("--only", default=",".join(SECTIONS), help=",".join(SECTIONS))
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=",".join(SYSTEMS))
    parser.add_argument("--keep-page-cache", action="store_true", help="skip the dropped cases")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="at most 2 runs, a 128 MiB model and 2 s loads: checks the script works",
    )
    parser.add_argument(
        "--warm-pool",
        type=int,
        default=1,
        help="the trims gateway's --warm-pool (1, its default; 0: every start forks)",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path, help="also write the tables here")
    parser.add_argument("--figure", type=Path, help="also draw the cases here (a .png)")
    parser.add_argument("--workdir", type=Path, help="a new folder to work in and keep (logs)")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.seconds = min(args.runs, 2), min(args.seconds, 2.0)
        args.model_mb = min(args.model_mb, 128)
    args.only = [s for s in args.only.split(",") if s]
    args.systems = [s for s in args.systems.split(",") if s]
    if set(args.only) - set(SECTIONS) or set(args.systems) - set(SYSTEMS) or not args.only:
        parser.error(f"--only takes {','.join(SECTIONS)}, --systems {','.join(SYSTEMS)}")
    if not args.systems or len(set(args.systems)) != len(args.systems):
        parser.error("--systems names each system once")
    if args.runs < 1 or args.model_mb < 1 or args.width < 1 or args.replicas < 1:
        parser.error("--runs, --model-mb, --width and --replicas must be at least 1")
    if args.workdir is not None and args.workdir.exists():
        parser.error(f"--workdir {args.workdir} exists; name a new folder")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    names = [s for s in args.systems if s != "trims"]
    if args.setup:
        return setup(names)
    peers: dict[str, Peer] = {}
    unavailable: dict[str, str] = {}
    for name in names:
        p = peer(name)
        why = p.unavailable()
        if why is None:
            peers[name] = p
        else:
            unavailable[name] = why
            print(f"{name} cannot run here: {why}", file=sys.stderr)
    import uvloop

    where = machine()
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="trims-peers-")))
        else:
            root = args.workdir
            root.mkdir(parents=True)
        root.chmod(0o755)  # a root gateway runs function code as nobody: code dirs live here
        doc = uvloop.run(run_all(root, args, args.only, peers))
    doc.update(
        runs=args.runs,
        quick=args.quick,
        model_mb=layers(args) * args.width * args.width * 4 / 2**20,
        systems=args.systems,
        machine=where,
        workers=args.workers,
        trims_warm_pool=args.warm_pool,
        trims_configuration=TRIMS_CONFIGURATION.format(
            warm_pool=args.warm_pool, concurrency=THROUGHPUT_CONCURRENCY
        ),
        unavailable=unavailable,
        peers={
            name: {"version": p.version(), "configuration": p.configuration}
            for name, p in peers.items()
        },
    )
    write_outputs(args.json, args.markdown, doc, render_markdown(doc))
    if args.figure is not None:
        write_figure(doc, args.figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
