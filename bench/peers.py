"""trims against Seldon MLServer, side by side: cold start to the first full response, memory
of N replicas, warm V2 throughput and tail latency.

    python bench/peers.py --setup            # MLServer's venv (once)
    python bench/peers.py [--runs 5] [--json OUT.json] [--markdown OUT.md]
    python bench/peers.py --quick            # 2 runs, 128 MiB model, short loads: a check

Both systems serve the same models (``peers_mlserver/peers_model.py``): ``full``, ``--model-mb``
MiB of Linear(4096, 4096) float32 layers (512 MiB = 8 layers), and a small MLP (64-256-256-10)
for throughput, each a safetensors file; the same V2 (Open Inference Protocol) JSON request,
a [1, 4096] (or [1, 64]) float32 ``input``, and the same torch forward pass over every weight.

* trims: a daemon (models in its CPU tier) and a gateway process (zygote executor); each
  model is a function serving ``infer``.
* MLServer 1.7.1 in its own venv (``$TRIMS_MLSERVER_VENV``, default
  ``/tmp/trims-mlserver-venv``) with the custom runtime ``peers_mlserver/peers_runtime.py``
  (safetensors ``load_file``: mmap, no copy). Cold starts use ``parallel_workers: 0`` (the model
  runs in the server process: no worker hop, and the warm request meets the same instance),
  memory ``--replicas`` workers, throughput ``--mlserver-workers`` (default: one per core).
  MLServer runs with ``OMP_WAIT_POLICY=PASSIVE`` (unless the environment sets it), as trims'
  workers do by default (Note [passive OpenMP threads] in ``runtime/functions/spec.py``):
  with the CPU torch build here its workers otherwise spin on the cores they share, and it
  answered 188 req/s at c=16 instead of 657.

Cases, interleaved run by run in ABBA order (even runs trims then MLServer for each tier, odd
runs MLServer first: a case measured right after the other system's work starts slower, and
with a fixed order trims' scale from zero always came right after MLServer's process start
and MLServer's load right after trims' standby), each with the page cache warm and
dropped right before (``echo 3 > /proc/sys/vm/drop_caches``), every warm run first: a drop
evicts the library code no live process has mapped, and a warm case that came right after
the other system's dropped one met a cache that was cold for it (trims' first responses took
2-3x as long there as in a run without MLServer: its worker read its torch's code back from
disk, and MLServer, which runs another install of torch, had read only its own):
``scale_from_zero`` (trims: a function with no instance, its model in the CPU tier, ``tier:
cpu``, or evicted to the disk tier, ``tier: disk``), ``standby`` (trims: a function with no
instance but a prepared standby, ``scaling.standby: 1``, CPU tier: the request activates it and
only ``init`` runs; the counterpart of MLServer's load into a server that already runs),
``load`` (MLServer: the repository API's
load call into a running server) and ``process_start`` (MLServer started with the model).
``first_response_ms`` ends at the first full response; ``warm_ms`` is the next request to the
same instance and ``overhead_ms`` the median per run of (first - warm). For trims,
``instance_start_ms`` is the gateway's own measure of the start (its cold-start metric),
``first_request_ms`` the rest of the first response, and ``first_request_ratio`` the median
per run of first request / warm request.

Note [idle memory]
~~~~~~~~~~~~~~~~~~
On some nodes memory that sat unread for a while is slower to read again (this 2-core VM:
a forward pass over 512 MiB took 1.6x its warm time after 1 s unread, 2.9x after 4 s;
``bench/idle_memory.py`` measures a node without trims). A first request reads weights that
sat unread since the case before, the warm request right after it reads them hot, so on such
a node first / warm measures the idle time as much as the cold start. For trims' cases a third
request to the same instance therefore waits first as long as the weights had sat unread
before the first one (``idle_ms``, counted from the benchmark's last full read or load of
them) and is timed as ``warm_idle_ms``: the warm request to hold the first one against. Not
for the disk tier with caches dropped, whose first request reads weights fresh from disk.
(Since 2026-12-07 a disk-tier re-load with a warm page cache maps the page-cache pages without
reading them, Note [trusted re-loads] in trims.daemon.residency, so those weights sat idle too.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

from trims.tables import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers_mlserver"))

from peers_model import MLP_SIZES, WIDTH, write_layers
from runtime_common import (
    closed_loop,
    drop_caches,
    free_port,
    machine,
    open_loop,
    pid_alive,
    pss_bytes,
    start_daemon,
    start_gateway,
    summary,
    tree_pids,
    write_outputs,
)

HERE = Path(__file__).resolve().parent
DEFAULT_VENV = "/tmp/trims-mlserver-venv"
#: What ``--setup`` installs: uvloop 0.23 crashes MLServer's worker pool ("There is no current
#: event loop"); torch is pinned to the CPU build (a plain ``torch`` pulls CUDA).
MLSERVER_PACKAGES = ("mlserver==1.7.1", "uvloop==0.21.0", "torch==2.13.0", "safetensors", "numpy")
SECTIONS = ("cold", "memory", "throughput")
SYSTEMS = ("trims", "mlserver")

FUNCTION = """
import os

import numpy as np
import torch
from peers_model import forward


def init(ctx):
    ctx.state["tensors"] = ctx.models["weights"].torch()


def infer(inputs, ctx):
    x = torch.from_numpy(np.ascontiguousarray(inputs["input"], dtype=np.float32))
    y = forward(ctx.state["tensors"], x, ctx.config.get("relu", False))
    return {"output": y.numpy(), "pid": np.array([os.getpid()], dtype=np.int64)}


def handler(request, ctx):
    return str(os.getpid())
"""


def venv_python() -> Path:
    return Path(os.environ.get("TRIMS_MLSERVER_VENV", DEFAULT_VENV)) / "bin" / "python"


def setup() -> int:
    """Create MLServer's venv and install :data:`MLSERVER_PACKAGES` into it."""
    python = venv_python()
    venv = python.parent.parent
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    cmd = [str(python), "-m", "pip", "install", "-q", "--prefer-binary", *MLSERVER_PACKAGES]
    if subprocess.run(cmd).returncode != 0:
        print(f"error: installing MLServer into {venv} failed (above)", file=sys.stderr)
        return 1
    print(f"MLServer ready in {venv}")
    return 0


def v2_body(width: int) -> bytes:
    data = [((i % 17) - 8) / 8.0 for i in range(width)]
    inputs = [{"name": "input", "datatype": "FP32", "shape": [1, width], "data": data}]
    return json.dumps({"inputs": inputs}).encode()


def answer_pid(doc: dict[str, Any]) -> int:
    pid = next(o for o in doc["outputs"] if o["name"] == "pid")["data"]
    return int(pid[0] if isinstance(pid, list) else pid)


class Infer:
    """POSTs one V2 JSON body to ``url`` (``.../v2/models/NAME/infer``)."""

    def __init__(self, session: Any, url: str, body: bytes) -> None:
        self.session, self.url, self.body = session, url, body
        self.headers = {"Content-Type": "application/json"}
        self.failures: dict[int, int] = {}

    async def pid(self) -> int:
        """The pid in a 200 answer; a request that found its pooled connection closed by the
        server before a byte was sent (a server just started can close the one it answered its
        not-ready probes on) is sent once more, on a new connection."""
        import aiohttp

        for attempt in (0, 1):
            try:
                async with self.session.post(self.url, data=self.body, headers=self.headers) as r:
                    text = await r.text()
                    if r.status != 200:
                        raise RuntimeError(f"{self.url} answered {r.status}: {text[:300]}")
                return answer_pid(json.loads(text))
            except (aiohttp.ClientOSError, aiohttp.ClientConnectionResetError) as e:
                unsent = isinstance(e, aiohttp.ClientConnectionResetError) or isinstance(
                    e.__cause__, aiohttp.ClientConnectionResetError
                )
                if attempt or not unsent:
                    raise
        raise AssertionError("unreachable")

    async def ok(self) -> bool:
        """Whether the answer was 200; other statuses are counted in :attr:`failures` (0: the
        connection failed)."""
        import aiohttp

        try:
            async with self.session.post(self.url, data=self.body, headers=self.headers) as r:
                await r.read()
                status = r.status
        except aiohttp.ClientError:
            status = 0
        if status != 200:
            self.failures[status] = self.failures.get(status, 0) + 1
        return status == 200


# ---- trims ----------------------------------------------------------------------------------


class Trims:
    """A daemon and a gateway process; functions serving ``peers_model`` from ``code``."""

    def __init__(self, root: Path, models: dict[str, Path], warm_pool: int = 1) -> None:
        from trims.runtime.client import StoreClient

        self.root, self.models = root, models
        #: when the CPU tier's copy of the models was last read or written whole (see
        #: :func:`trims_cold`)
        self.touched = time.perf_counter()
        budget = sum(p.stat().st_size for p in models.values()) * 2 + (256 << 20)
        self.daemon, self.socket = start_daemon(root, cpu_budget=f"{budget >> 20}MiB")
        try:
            self.code = root / "code"
            self.code.mkdir()
            (self.code / "peersfn.py").write_text(FUNCTION)
            shutil.copy(HERE / "peers_mlserver" / "peers_model.py", self.code)
            with StoreClient(self.socket) as client:
                for name, path in models.items():
                    client.add(name, path)
                    client.load(name, tier="cpu")
            self.touched = time.perf_counter()
            # the benchmark's client is one peer standing for many users
            self.gateway, self.url = start_gateway(
                root, "--store-socket", str(self.socket), "--max-connections-per-peer", "1024",
                "--warm-pool", str(warm_pool),
            )  # fmt: skip
        except BaseException:
            self.daemon.stop()
            raise

    def stop(self) -> None:
        self.gateway.stop()
        self.daemon.stop()

    def store(self, op: str, model: str) -> None:
        from trims.runtime.client import StoreClient

        with StoreClient(self.socket) as client:
            if op == "evict":
                client.evict(model, tier="cpu")
            else:
                client.load(model, tier="cpu")
                self.touched = time.perf_counter()

    def spec(self, name: str, model: str, width_in: int, **scaling: Any) -> dict[str, Any]:
        out = [
            {"name": "output", "datatype": "FP32", "shape": [-1, -1]},
            {"name": "pid", "datatype": "INT64", "shape": [1]},
        ]
        return {
            "name": name,
            "handler": "peersfn:handler",
            "code_dir": str(self.code),
            "models": [{"name": model, "alias": "weights", "source": str(self.models[model])}],
            "config": {"relu": model == "mlp"},
            "serves": {
                "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, width_in]}],
                "outputs": out,
            },
            "scaling": {"request_timeout_s": 300, "queue_size": 1024, **scaling},
        }

    async def deploy(self, session: Any, spec: dict[str, Any]) -> str:
        async with session.put(f"{self.url}/v1/functions/{spec['name']}", json=spec) as r:
            if r.status not in (200, 201):
                raise RuntimeError(f"deploying {spec['name']}: {r.status} {await r.text()}")
        return f"{self.url}/v2/models/{spec['name']}/infer"

    async def delete(self, session: Any, name: str, pids: set[int]) -> None:
        async with session.delete(f"{self.url}/v1/functions/{name}") as r:
            await r.read()
        while any(pid_alive(p) for p in pids):
            await asyncio.sleep(0.02)

    async def standby_prepared(self, session: Any, name: str) -> None:
        """Poll the function until its standby says it is prepared (not timed)."""
        while True:
            async with session.get(f"{self.url}/v1/functions/{name}") as r:
                doc = await r.json()
            if any(i.get("prepared") for i in doc["status"]["instances"]):
                return
            await asyncio.sleep(0.02)

    async def instance_start_ms(self, session: Any, name: str) -> float | None:
        from runtime_common import parse_metric

        async with session.get(f"{self.url}/metrics") as r:
            text = await r.text()
        value = parse_metric(text, "trims_cold_start_seconds_sum", {"function": name})
        return None if value is None else value * 1e3

    def pids(self) -> list[int]:
        return [self.daemon.proc.pid, *tree_pids(self.gateway.proc.pid)]


# ---- MLServer -------------------------------------------------------------------------------


class MLServer:
    """``mlserver start`` on a repository of ``models`` (name -> (path, relu))."""

    def __init__(
        self,
        root: Path,
        models: dict[str, tuple[Path, bool]],
        workers: int,
        at_startup: bool = True,
    ) -> None:
        self.http = free_port()
        repo = root / f"mlserver-{self.http}"
        repo.mkdir()
        settings = {
            "http_port": self.http,
            "grpc_port": free_port(),
            "metrics_port": free_port(),
            "parallel_workers": workers,
            "load_models_at_startup": at_startup,
            "debug": False,
        }
        (repo / "settings.json").write_text(json.dumps(settings))
        for name, (path, relu) in models.items():
            (repo / name).mkdir()
            model = {
                "name": name,
                "implementation": "peers_runtime.PeersModel",
                "parameters": {"uri": str(path), "extra": {"relu": relu}},
            }
            (repo / name / "model-settings.json").write_text(json.dumps(model))
        self.url = f"http://127.0.0.1:{self.http}"
        self.log = (root / f"mlserver-{self.http}.log").open("ab")
        # its best configuration: OpenMP threads that do not spin (see the module docstring)
        runtime_path = str(HERE / "peers_mlserver")
        env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, "PYTHONPATH": runtime_path}
        mlserver = venv_python().parent / "mlserver"
        self.proc = subprocess.Popen(
            [str(mlserver), "start", str(repo)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def infer_url(self, model: str) -> str:
        return f"{self.url}/v2/models/{model}/infer"

    async def wait(self, session: Any, ready: Callable[[], Awaitable[Any]]) -> Any:
        """Poll ``ready`` until it answers (connection refused meanwhile)."""
        import aiohttp

        deadline = time.perf_counter() + 180
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlserver exited ({self.proc.returncode}); see {self.log.name}")
            try:
                return await ready()
            except (aiohttp.ClientError, RuntimeError):
                if time.perf_counter() > deadline:
                    raise
            await asyncio.sleep(0.005)

    async def live(self, session: Any) -> None:
        async def check() -> None:
            async with session.get(f"{self.url}/v2/health/live") as r:
                if r.status != 200:
                    raise RuntimeError("not live yet")

        await self.wait(session, check)

    async def repository(self, session: Any, model: str, op: str) -> None:
        async with session.post(f"{self.url}/v2/repository/models/{model}/{op}") as r:
            if r.status != 200:
                raise RuntimeError(f"MLServer {op} {model}: {r.status} {await r.text()}")

    def pids(self) -> list[int]:
        return tree_pids(self.proc.pid)

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


# ---- measures -------------------------------------------------------------------------------


def prepare_cache(cache: str) -> None:
    """Drop the page cache for ``cache == "dropped"`` (checked to work in :func:`run_all`)."""
    if cache == "dropped":
        drop_caches()


class ColdRun(NamedTuple):
    """One run of a cold case, in seconds (see :func:`trims_cold`)."""

    first: float
    warm: float
    #: trims: a warm request after the weights sat idle as long as they had before ``first``
    #: (None for the disk tier with caches dropped, whose first request reads them fresh from
    #: disk, and for MLServer)
    warm_idle: float | None = None
    #: trims: how long the weights had sat unread when ``first`` was sent (None
    #: where ``warm_idle`` is)
    idle: float | None = None
    #: trims: the instance start as the gateway measured it (its metric), in ms
    start_ms: float | None = None


async def trims_cold(
    session: Any, trims: Trims, name: str, width: int, tier: str, cache: str, standby: bool
) -> ColdRun:
    """First and warm response of a new function (no instance) on ``full``, and its instance
    start as the gateway saw it; with ``standby`` the function keeps one (``scaling.standby:
    1``), prepared before the cache is dropped and the clock starts.

    A third request, to the same instance, waits first as long as the CPU tier's weights had
    sat unread before the first one (Note [idle memory] in the module's docstring): the warm
    request such a first request should be held against."""
    spec = trims.spec(name, "full", width, max_instances=1, standby=int(standby))
    url = await trims.deploy(session, spec)
    if standby:
        await trims.standby_prepared(session, name)
    if tier == "disk":
        trims.store("evict", "full")
    prepare_cache(cache)
    infer = Infer(session, url, v2_body(width))
    t0 = time.perf_counter()
    idle = t0 - trims.touched
    pid = await infer.pid()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert await infer.pid() == pid, "the warm request met another instance"
    warm = time.perf_counter() - t0
    trims.touched = time.perf_counter()
    warm_idle = None
    if tier == "cpu" or cache == "warm":
        await asyncio.sleep(idle)
        t0 = time.perf_counter()
        assert await infer.pid() == pid, "the warm request met another instance"
        warm_idle = time.perf_counter() - t0
        trims.touched = time.perf_counter()
    start = await trims.instance_start_ms(session, name)
    await trims.delete(session, name, {pid})
    if tier == "disk":
        trims.store("load", "full")
    return ColdRun(first, warm, warm_idle, idle if warm_idle is not None else None, start)


#: cold runs by (system, case, tier, page cache)
ColdRuns = dict[tuple[str, str, str | None, str], list[ColdRun]]


async def _trims_cold_cases(
    session: Any,
    trims: Trims,
    args: argparse.Namespace,
    tier: str,
    cache: str,
    run: int,
    runs: ColdRuns,
) -> None:
    """trims' cases of one run for ``tier``: scale from zero, then (CPU tier) a standby."""
    for standby in (False, True) if tier == "cpu" else (False,):
        case = "standby" if standby else "scale_from_zero"
        name = f"full-{tier}-{cache}-{run}{'-sb' if standby else ''}"
        r = await trims_cold(session, trims, name, args.width, tier, cache, standby)
        runs.setdefault(("trims", case, tier, cache), []).append(r)
        log_run("trims", f"{case}/{tier}", cache, run, r)


async def cold(
    session: Any, trims: Trims, root: Path, full: Path, args: argparse.Namespace, caches: list[str]
) -> list[dict[str, Any]]:
    runs: ColdRuns = {}
    loader = None
    if "mlserver" in args.systems:
        loader = MLServer(root, {"full": (full, False)}, workers=0, at_startup=False)
    try:
        if loader is not None:
            await loader.live(session)
            # untimed: the server's first load imports the runtime (torch) into it
            await mlserver_cold(session, loader, root, full, v2_body(args.width), "warm", "load")
        # every warm-cache run before the dropped ones: see the module's docstring
        for cache in caches:
            for run in range(args.runs):
                for tier, peer_case in (("cpu", "load"), ("disk", "process_start")):
                    # ABBA: each system goes first in every other run (see the docstring)
                    for system in ("trims", "mlserver") if run % 2 == 0 else ("mlserver", "trims"):
                        if system == "trims" and "trims" in args.systems:
                            await _trims_cold_cases(session, trims, args, tier, cache, run, runs)
                        elif system == "mlserver" and loader is not None:
                            body = v2_body(args.width)
                            r = await mlserver_cold(
                                session, loader, root, full, body, cache, peer_case
                            )
                            runs.setdefault(("mlserver", peer_case, None, cache), []).append(r)
                            log_run("mlserver", peer_case, cache, run, r)
    finally:
        if loader is not None:
            loader.stop()
    return [cold_row(key, rs) for key, rs in runs.items()]


def _median_ms(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) * 1e3 if known else None


def cold_row(key: tuple[str, str, str | None, str], runs: list[ColdRun]) -> dict[str, Any]:
    system, case, tier, cache = key
    s = summary([r.first for r in runs])
    starts = [r.start_ms for r in runs if r.start_ms is not None]
    requests = [r.first * 1e3 - r.start_ms for r in runs if r.start_ms is not None]
    ratios = [(r.first * 1e3 - r.start_ms) / (r.warm * 1e3) for r in runs if r.start_ms is not None]
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
        "instance_start_ms": statistics.median(starts) if starts else None,
        # trims: the first request alone (first response less the gateway's instance start),
        # and the median per run of it over the warm request right after it
        "first_request_ms": statistics.median(requests) if requests else None,
        "first_request_ratio": statistics.median(ratios) if ratios else None,
        # the first request (first response less the instance start) against a warm request
        # after the same idle (Note [idle memory])
        "warm_idle_ms": _median_ms([r.warm_idle for r in runs]),
        "idle_ms": _median_ms([r.idle for r in runs]),
    }


async def mlserver_cold(
    session: Any, loader: MLServer, root: Path, full: Path, body: bytes, cache: str, case: str
) -> ColdRun:
    """First and warm response after a load call into ``loader`` (``case == "load"``) or after
    starting a new server with the model (``"process_start"``)."""
    if case == "load":
        infer = Infer(session, loader.infer_url("full"), body)
        prepare_cache(cache)
        t0 = time.perf_counter()
        await loader.repository(session, "full", "load")
        pid = await infer.pid()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert await infer.pid() == pid
        warm = time.perf_counter() - t0
        await loader.repository(session, "full", "unload")
        return ColdRun(first, warm)
    prepare_cache(cache)
    t0 = time.perf_counter()
    server = MLServer(root, {"full": (full, False)}, workers=0)
    try:
        infer = Infer(session, server.infer_url("full"), body)
        pid = await server.wait(session, infer.pid)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert await infer.pid() == pid
        warm = time.perf_counter() - t0
    finally:
        server.stop()
    return ColdRun(first, warm)


def log_run(system: str, case: str, cache: str, run: int, r: ColdRun) -> None:
    idle = (
        ""
        if r.warm_idle is None or r.idle is None
        else f", warm after {r.idle * 1e3:.0f} ms idle {r.warm_idle * 1e3:7.1f} ms"
    )
    print(
        f"{system:>8} {case:>22} cache {cache:<7} run {run}: first {r.first * 1e3:8.1f} ms, "
        f"warm {r.warm * 1e3:7.1f} ms{idle}",
        file=sys.stderr,
    )


async def distinct_pids(infer: Infer, n: int) -> set[int]:
    """Concurrent full forward passes until ``n`` different processes answered (each of them
    has then read every weight)."""
    seen: set[int] = set()
    for _ in range(50):
        seen |= set(await asyncio.gather(*(infer.pid() for _ in range(n))))
        if len(seen) >= n:
            return seen
    raise RuntimeError(f"only {len(seen)} of {n} replicas answered after 50 rounds")


def total_pss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += pss_bytes(pid)
        except Exception:  # a process that ended meanwhile holds nothing
            continue
    return total / 2**20


async def memory(
    session: Any, trims: Trims, root: Path, full: Path, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Total PSS of each system with ``args.replicas`` replicas of ``full``, each having run
    a full forward pass (so each has mapped every weight)."""
    n, body = args.replicas, v2_body(args.width)
    pss: dict[str, float] = {}
    if "trims" in args.systems:
        spec = trims.spec("full-replicas", "full", args.width, min_instances=n, max_instances=n)
        pids = await distinct_pids(Infer(session, await trims.deploy(session, spec), body), n)
        pss["trims"] = total_pss_mib(trims.pids())
        await trims.delete(session, "full-replicas", pids)
    if "mlserver" in args.systems:
        server = MLServer(root, {"full": (full, False)}, workers=n)
        try:
            infer = Infer(session, server.infer_url("full"), body)
            await server.wait(session, infer.pid)
            await distinct_pids(infer, n)
            pss["mlserver"] = total_pss_mib(server.pids())
        finally:
            server.stop()
    model_mib = full.stat().st_size / 2**20
    for system, mib in pss.items():
        print(f"memory, {n} replicas: {system} {mib:.0f} MiB", file=sys.stderr)
    return [
        {"system": s, "replicas": n, "pss_mib": p, "model_mib": model_mib} for s, p in pss.items()
    ]


async def throughput(
    session: Any, trims: Trims, root: Path, mlp: Path, args: argparse.Namespace
) -> list[dict[str, Any]]:
    body = v2_body(MLP_SIZES[0])
    n = args.mlserver_workers
    sides: dict[str, Infer] = {}
    if "trims" in args.systems:
        spec = trims.spec("mlp", "mlp", MLP_SIZES[0], min_instances=n, max_instances=n)
        sides["trims"] = Infer(session, await trims.deploy(session, spec), body)
    server = None
    if "mlserver" in args.systems:
        server = MLServer(root, {"mlp": (mlp, True)}, workers=n)
        sides["mlserver"] = Infer(session, server.infer_url("mlp"), body)
    samples: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    try:
        if server is not None:
            await server.wait(session, sides["mlserver"].pid)
        for infer in sides.values():
            await distinct_pids(infer, n)
        for run in range(args.runs):
            for c in (1, 16):
                for system, infer in sides.items():
                    infer.failures = {}
                    r = await closed_loop(infer.ok, c, args.seconds)
                    r["statuses"] = infer.failures
                    samples.setdefault((system, "closed", c), []).append(r)
                    print(
                        f"{system:>8} closed c={c} run {run}: {r['rps']:.0f} req/s, "
                        f"p99 {r['p99_ms']:.2f} ms",
                        file=sys.stderr,
                    )
            for system, infer in sides.items():
                rate = 0.8 * statistics.median(s["rps"] for s in samples[(system, "closed", 16)])
                infer.failures = {}
                r = await open_loop(infer.ok, rate, args.seconds)
                r["statuses"] = infer.failures
                samples.setdefault((system, "open", 16), []).append(r)
                print(
                    f"{system:>8} open {rate:.0f}/s run {run}: p50 {r['p50_ms']:.2f} ms, "
                    f"p99 {r['p99_ms']:.2f} ms",
                    file=sys.stderr,
                )
    finally:
        if server is not None:
            server.stop()

    def med(rs: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in rs if r.get(key) is not None]
        return statistics.median(values) if values else None

    return [
        {
            "system": system,
            "mode": mode,
            "concurrency": c if mode == "closed" else None,
            "rate": med(rs, "rate") if mode == "open" else None,
            "rps": med(rs, "rps"),
            "p50_ms": med(rs, "p50_ms"),
            "p99_ms": med(rs, "p99_ms"),
            "errors": sum(r["errors"] for r in rs),
            "error_statuses": merged_statuses(rs),
            "runs": len(rs),
        }
        for (system, mode, c), rs in samples.items()
    ]


def merged_statuses(results: list[dict[str, Any]]) -> dict[str, int]:
    """HTTP status -> count of the non-200 answers over ``results`` (JSON keys are text)."""
    out: dict[str, int] = {}
    for r in results:
        for status, count in r["statuses"].items():
            out[str(status)] = out.get(str(status), 0) + count
    return out


# ---- report ---------------------------------------------------------------------------------


def _ms(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_markdown(doc: dict[str, Any]) -> str:
    """The three tables of ``doc`` (as :func:`main` writes it)."""
    label = " (quick: a check, not a measurement)" if doc.get("quick") else ""
    parts = [
        f"trims vs MLServer {doc.get('mlserver_version') or '(not run)'}{label}; {doc['machine']}; "
        f"{doc['runs']} runs, medians (min-max); trims gateway --warm-pool "
        f"{doc.get('trims_warm_pool', 0)}."
    ]
    if doc.get("cold_start"):
        rows = [
            [
                r["system"],
                r["case"] + (f" ({r['tier']} tier)" if r.get("tier") else ""),
                r["cache"],
                f"{_ms(r['first_response_ms'])} ({_ms(r['min_ms'])}-{_ms(r['max_ms'])})",
                _ms(r["warm_ms"]),
                _ms(r["overhead_ms"]),
                _ms(r.get("instance_start_ms")),
                _ms(r.get("first_request_ms"))
                + (
                    f" ({r['first_request_ratio']:.2f}x)"
                    if r.get("first_request_ratio") is not None
                    else ""
                ),
                _ms(r.get("warm_idle_ms"))
                + (f" ({r['idle_ms'] / 1e3:.1f} s)" if r.get("idle_ms") is not None else ""),
            ]
            for r in doc["cold_start"]
        ]
        parts.append(
            markdown_table(
                [
                    "system",
                    "case",
                    "page cache",
                    "first full response ms",
                    "warm ms",
                    "overhead ms",
                    "instance start ms",
                    "first request ms (/ warm)",
                    "warm after the same idle ms (idle)",
                ],
                rows,
            )
        )
    if doc.get("memory"):
        rows = [
            [
                r["system"],
                r["replicas"],
                f"{r['pss_mib']:.0f}",
                f"{r['model_mib']:.0f}",
                f"{r['pss_mib'] / r['model_mib']:.2f}x",
            ]
            for r in doc["memory"]
        ]
        parts.append(
            markdown_table(
                ["system", "replicas", "total PSS MiB", "model MiB", "PSS / model"], rows
            )
        )
    if doc.get("throughput"):
        rows = [
            [
                r["system"],
                r["mode"],
                f"c={r['concurrency']}" if r["mode"] == "closed" else f"{r['rate']:.0f}/s",
                f"{r['rps']:.0f}",
                _ms(r["p50_ms"], 2),
                _ms(r["p99_ms"], 2),
                ", ".join(f"{n} x {st}" for st, n in r.get("error_statuses", {}).items())
                or r["errors"],
            ]
            for r in doc["throughput"]
        ]
        parts.append(
            markdown_table(
                ["system", "loop", "concurrency / rate", "req/s", "p50 ms", "p99 ms", "errors"],
                rows,
            )
        )
    parts.extend(f"Note: {n}" for n in doc.get("notes", []))
    return "\n\n".join(parts) + "\n"


async def run_all(root: Path, args: argparse.Namespace, only: list[str]) -> dict[str, Any]:
    import aiohttp

    full, mlp = root / "full.safetensors", root / "mlp.safetensors"
    write_layers(full, (args.width,) * (layers(args) + 1))
    write_layers(mlp, MLP_SIZES)
    caches = ["warm"] if args.keep_page_cache else ["warm", "dropped"]
    doc: dict[str, Any] = {"cold_start": [], "memory": [], "throughput": [], "notes": []}
    if "dropped" in caches and "cold" in only and (why := drop_caches()):
        caches.remove("dropped")
        doc["notes"].append(f"the dropped-cache cases were skipped: {why}")
    trims = Trims(root, {"full": full, "mlp": mlp}, args.warm_pool)
    # Idle connections are closed here before a server closes them (MLServer's uvicorn after
    # 5 s): a request sent on one the server was closing failed with "Server disconnected".
    connector = aiohttp.TCPConnector(limit=1024, keepalive_timeout=2.0)
    timeout = aiohttp.ClientTimeout(total=600)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            if "cold" in only:
                doc["cold_start"] = await cold(session, trims, root, full, args, caches)
            if "memory" in only:
                doc["memory"] = await memory(session, trims, root, full, args)
            if "throughput" in only:
                doc["throughput"] = await throughput(session, trims, root, mlp, args)
    finally:
        trims.stop()
    return doc


def mlserver_version() -> str:
    out = subprocess.run(
        [str(venv_python()), "-c", "import mlserver; print(mlserver.__version__)"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def layers(args: argparse.Namespace) -> int:
    """Linear(width, width) float32 layers in ``--model-mb`` MiB (at least one)."""
    return max(1, (args.model_mb << 20) // (args.width * args.width * 4))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setup", action="store_true", help="create MLServer's venv and exit")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--model-mb", type=int, default=512, help="size of the full model")
    parser.add_argument(
        "--width", type=int, default=WIDTH, help="of its square layers (4096: 64 MiB a layer)"
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument(
        "--mlserver-workers",
        type=int,
        default=os.cpu_count() or 1,
        help="MLServer parallel_workers and trims instances for throughput",
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="per throughput run")
    parser.add_argument("--only", default=",".join(SECTIONS), help="cold,memory,throughput")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="trims,mlserver")
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
    parser.add_argument("--workdir", type=Path, help="a new folder to work in and keep (logs)")
    args = parser.parse_args()
    if args.setup:
        return setup()
    if args.quick:
        args.runs, args.seconds = min(args.runs, 2), min(args.seconds, 2.0)
        args.model_mb = min(args.model_mb, 128)
    only = [s for s in args.only.split(",") if s]
    args.systems = [s for s in args.systems.split(",") if s]
    if set(only) - set(SECTIONS) or set(args.systems) - set(SYSTEMS) or not only:
        parser.error(f"--only takes {','.join(SECTIONS)}, --systems {','.join(SYSTEMS)}")
    if args.runs < 1 or args.model_mb < 1 or args.width < 1:
        parser.error("--runs, --model-mb and --width must be at least 1")
    if "mlserver" in args.systems and not venv_python().exists():
        print(
            f"error: no MLServer at {venv_python()}; run python bench/peers.py --setup "
            "(or set TRIMS_MLSERVER_VENV)",
            file=sys.stderr,
        )
        return 2
    if args.workdir is not None and args.workdir.exists():
        parser.error(f"--workdir {args.workdir} exists; name a new folder")
    import uvloop

    where = machine()
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="trims-peers-")))
        else:
            root = args.workdir
            root.mkdir(parents=True)
        root.chmod(0o755)  # a root gateway runs function code as nobody: code dirs live here
        doc = uvloop.run(run_all(root, args, only))
    doc.update(
        runs=args.runs,
        quick=args.quick,
        model_mb=layers(args) * args.width * args.width * 4 / 2**20,
        systems=args.systems,
        machine=where,
        mlserver_version=mlserver_version() if "mlserver" in args.systems else None,
        mlserver_workers=args.mlserver_workers,
        trims_warm_pool=args.warm_pool,
    )
    write_outputs(args.json, args.markdown, doc, render_markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
