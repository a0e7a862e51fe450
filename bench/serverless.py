"""A node under a serverless trace: many functions, more models than memory, one memory limit.

    python bench/serverless.py [--json OUT.json --markdown OUT.md --figure docs/img/serverless.png]
    python bench/serverless.py --quick        # 20 functions, 2 minutes, 2 GiB of models: a check
    python bench/serverless.py --write-trace T.json [--azure FILE.csv]   # Azure 2019 format
    python bench/serverless.py --trace T.json --systems trims --rate-scale 1,2

The trace (``serverless_trace.py``): F functions (``--functions``, 200) over T minutes
(``--minutes``, 10), Azure-like popularity and bursts, each function its own model, the models
totalling ``--total-mib`` (12 GiB) against a memory budget of a quarter of that (``--budget-mib``).
``--azure FILE`` replays a real Azure Functions 2019 per-minute file instead; ``--write-trace``
saves the trace and ``--trace`` replays a saved one, so every system gets the same requests.

Each system (``--systems``: ``trims``, ``trims store off``) runs inside one memory cgroup
(``serverless_harness.Cgroup``: ``trims-bench-<pid>-<system>``, limit = the budget, swap off)
holding all of its processes, started fresh for every rate, its models on disk with the page
cache dropped. A rate run replays the trace ``scale`` times faster (``serverless_trace``'s
docstring says why compression), at most ``--run-seconds`` of it, open loop (every request at
its time; latency from that time), one V2 JSON infer per request. The first
``--warmup-seconds`` (15, at most a third of the replay) are sent but not measured: a system
starts empty, and without them the first requests of its busiest functions, on a page cache
just dropped, count in every run, though a node in service has those warm (at the lowest scales
the window holds few requests, and a handful of such misses is more than 1% of them).

* ``trims``: ``trims daemon`` (no ``--cpu-budget``: its default, sized from its cgroup) and
  ``trims gateway`` (its defaults; ``--max-connections-per-peer 4096`` because the benchmark's
  client is one local user standing for many), both in the cgroup; every model added to the
  store (its disk tier; the store directory is kept between rates), one function per model
  (the ``bench/peers_trims.py`` function code, default scaling).
* ``trims store off``: the gateway alone, pointed at a socket where no daemon listens, so each
  instance loads its own copy of its model from the file (as ``bench/density.py`` runs "no store").

SLO: a request meets it when answered 200 within max(1 s, 10 x its model's warm latency). Warm
latency comes from the model size with a calibration: before any run, outside the cgroup, one
process loads up to :data:`CALIBRATION_POINTS` models spread over the size range and times
``peers_model.forward`` (median of 7 after 3 warm-ups); a least-squares line through those
points gives every model's warm latency. The sustainable rate is the largest scale at which at
least 99% of the requests meet their SLO (``serverless_harness.search``: doubling, then
bisection, at most ``--max-runs`` runs per system), reported in requests per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from trims.tables import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers_mlserver"))

from peer_base import MODEL_CODE, v2_body
from peers_model import write_layers
from peers_trims import FUNCTION
from runtime_common import machine, start_daemon, start_gateway, write_outputs
from serverless_harness import (
    MIB,
    SLO_TARGET,
    BenchModel,
    Cgroup,
    CgroupUnavailable,
    System,
    SystemBase,
    cgroup,
    evict_page_cache,
    measure,
    replay,
    search,
)
from serverless_trace import (
    Trace,
    TraceParams,
    azure,
    describe,
    read_trace,
    synthetic,
    write_trace,
)

HERE = Path(__file__).resolve().parent
#: models timed for the warm-latency calibration
CALIBRATION_POINTS = 5
#: the SLO's floor and its multiple of the warm latency
SLO_FLOOR_S, SLO_FACTOR = 1.0, 10.0
#: the defaults --quick overrides; its largest model is about a third of the 512 MiB limit, as
#: the defaults' 1 GiB is of 3 GiB (a model near the limit itself cannot be served by any system)
QUICK = {"functions": 20, "minutes": 2.0, "total_mib": 2048.0, "max_mib": 192.0,
         "run_seconds": 30.0, "max_runs": 3}  # fmt: skip


# ---- trims ----------------------------------------------------------------------------------


def metric_sum(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (any labels) in Prometheus text."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


class TrimsSystem(SystemBase):
    """trims with its defaults (``store=True``) or with the store off."""

    def __init__(self, root: Path, store: bool) -> None:
        self.name = "trims" if store else "trims store off"
        self.root, self.store = root, store
        self.code = root / "code"
        self.code.mkdir(parents=True, exist_ok=True)
        (self.code / "peersfn.py").write_text(FUNCTION)
        shutil.copy(MODEL_CODE / "peers_model.py", self.code)
        self.daemon: Any = None
        self.gateway: Any = None
        self.url = ""
        self.socket = root / "no-store.sock"

    def start(self, cgroup: Cgroup) -> None:
        prefix = cgroup.command_prefix()
        try:
            if self.store:
                self.daemon, self.socket = start_daemon(self.root, cpu_budget=None, prefix=prefix)
            self.gateway, self.url = start_gateway(
                self.root, "--store-socket", str(self.socket),
                "--max-connections-per-peer", "4096", prefix=prefix,
            )  # fmt: skip
        except BaseException:
            self.stop()
            raise

    async def deploy(self, session: Any, models: Sequence[BenchModel]) -> None:
        if self.store:
            await asyncio.to_thread(self._add, models)
        sem = asyncio.Semaphore(8)

        async def put(m: BenchModel) -> None:
            async with sem, session.put(f"{self.url}/v1/functions/{m.function}",
                                        json=self.spec(m)) as r:  # fmt: skip
                if r.status not in (200, 201):
                    raise RuntimeError(f"deploying {m.function}: {r.status} {await r.text()}")

        await asyncio.gather(*(put(m) for m in models))

    def _add(self, models: Sequence[BenchModel]) -> None:
        """Every model into the store (its disk tier); the store directory outlives a rate's
        daemon, so only the first rate adds them."""
        from trims.runtime.client import StoreClient

        with StoreClient(self.socket) as client:
            known = {m["name"] for m in client.list(admin=True)}
            for m in models:
                if m.name not in known:
                    client.add(m.name, m.path)

    def spec(self, m: BenchModel) -> dict[str, Any]:
        """The ``bench/peers_trims.py`` function, its scaling left at the gateway's defaults."""
        return {
            "name": m.function,
            "handler": "peersfn:handler",
            "code_dir": str(self.code),
            "models": [{"name": m.name, "alias": "weights", "source": str(m.path)}],
            "config": {"relu": False},
            "serves": {
                "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, m.width]}],
                "outputs": [
                    {"name": "output", "datatype": "FP32", "shape": [-1, -1]},
                    {"name": "pid", "datatype": "INT64", "shape": [1]},
                ],
            },
        }

    def infer_url(self, function: str) -> str:
        return f"{self.url}/v2/models/{function}/infer"

    async def counters(self, session: Any) -> dict[str, Any]:
        async with session.get(f"{self.url}/metrics") as r:
            text = await r.text()
        count = metric_sum(text, "trims_cold_start_seconds_count")
        total = metric_sum(text, "trims_cold_start_seconds_sum")
        return {
            "cold_starts": int(metric_sum(text, "trims_cold_starts_total")),
            "cold_start_mean_ms": total / count * 1e3 if count else None,
            "instance_failures": int(metric_sum(text, "trims_instance_failures_total")),
        }

    def stop(self) -> None:
        for proc in (self.gateway, self.daemon):
            if proc is not None:
                proc.stop()
        self.gateway = self.daemon = None


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name)


#: every system by the name ``--systems`` takes: a factory given the folder it may keep
#: state in between rates (a peer adapter plugs in here)
SYSTEMS: dict[str, Callable[[Path], System]] = {
    "trims": lambda root: TrimsSystem(root / "trims", store=True),
    "trims store off": lambda root: TrimsSystem(root / "trims-store-off", store=False),
}


# ---- models and their SLOs ------------------------------------------------------------------


def write_models(trace: Trace, folder: Path) -> list[BenchModel]:
    """Each function's model file (kept in ``folder`` and reused when its shape matches)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, f in enumerate(trace.functions):
        m = f.model
        path = folder / f"{m.name}-{m.width}x{m.layers}.safetensors"
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            write_layers(tmp, (m.width,) * (m.layers + 1), seed=i)
            tmp.rename(path)
        out.append(BenchModel(f.name, m.name, path, m.width, m.bytes))
    return out


def time_forward(points: Sequence[tuple[str, int]]) -> list[float]:
    """Warm seconds of ``peers_model.forward`` over each (file, width): median of 7 after 3
    warm-ups (run in a child process: its torch threads never share the run's cores)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import statistics

    import torch
    from peers_model import forward
    from safetensors.torch import load_file

    out = []
    for path, width in points:
        tensors = load_file(path)
        x = torch.ones(1, width)
        for _ in range(3):
            forward(tensors, x, False)
        samples = []
        for _ in range(7):
            t0 = time.perf_counter()
            forward(tensors, x, False)
            samples.append(time.perf_counter() - t0)
        out.append(statistics.median(samples))
        del tensors
    return out


def calibrate(models: Sequence[BenchModel]) -> dict[str, Any]:
    """Warm latency per model from a line through :data:`CALIBRATION_POINTS` timed ones."""
    ordered = sorted(models, key=lambda m: m.bytes)
    picks = sorted({round(k * (len(ordered) - 1) / (CALIBRATION_POINTS - 1))
                    for k in range(CALIBRATION_POINTS)})  # fmt: skip
    chosen = [ordered[k] for k in picks]
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        seconds = pool.submit(time_forward, [(str(m.path), m.width) for m in chosen]).result()
    evict_page_cache([m.path for m in chosen])
    xs = [m.bytes / MIB for m in chosen]
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(seconds) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    covar = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, seconds, strict=True))
    slope = max(0.0, covar / var) if var else 0.0
    intercept = mean_y - slope * mean_x
    floor = min(seconds)
    warm = {m.function: max(floor, intercept + slope * m.bytes / MIB) for m in models}
    return {
        "method": f"calibrated: forward pass of {n} models timed, a line through them",
        "points": [{"model_mib": x, "warm_ms": y * 1e3} for x, y in zip(xs, seconds, strict=True)],
        "ms_per_mib": slope * 1e3,
        "intercept_ms": intercept * 1e3,
        "warm_s": warm,
    }


# ---- running one system ---------------------------------------------------------------------


async def run_rate(
    system: System,
    trace: Trace,
    models: Sequence[BenchModel],
    slo_s: Sequence[float],
    scale: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One rate: the system started in a new cgroup, deployed, the trace window replayed."""
    import aiohttp

    schedule = trace.window(scale, args.run_seconds)
    window = min(trace.duration_s / scale, args.run_seconds)
    functions = [f.name for f in trace.functions]
    bodies = [v2_body(m.width) for m in models]
    budget = int(args.budget_mib * MIB)
    name = f"trims-bench-{os.getpid()}-{_slug(system.name)}"
    evict_page_cache([args.models_dir, args.workdir])
    connector = aiohttp.TCPConnector(limit=4096)
    timeout = aiohttp.ClientTimeout(total=args.client_timeout)
    with cgroup(name, budget) as group:
        t0 = time.perf_counter()
        system.start(group)
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                await system.deploy(session, models)
                deploy_s = time.perf_counter() - t0
                # what deploying read stays on disk: the replay starts from a cold page cache
                evict_page_cache([args.models_dir, args.workdir])
                group.reset_peak()
                oom_before = group.oom_kills()
                run = await replay(system, session, schedule, functions, bodies, group)
                try:
                    counters = await system.counters(session)
                except (TimeoutError, aiohttp.ClientError, OSError) as e:
                    counters = {"unavailable": f"{type(e).__name__}: {e}"}
        finally:
            system.stop()
        peak = group.peak()
        sampled = max((b for _, b, _ in run.memory), default=0)
        oom = group.oom_kills() - oom_before
    warmup = min(args.warmup_seconds, window / 3)
    r = measure(run, slo_s, trace.head(), window, warmup)
    r.update(
        scale=scale,
        offered_rps=len(schedule) / window if window > 0 else 0.0,
        window_s=window,
        warmup_s=warmup,
        deploy_s=deploy_s,
        oom_kills=oom,
        peak_memory_mib=max(peak or 0, sampled) / MIB,
        peak_working_set_mib=max((w for _, _, w in run.memory), default=0) / MIB,
        budget_mib=args.budget_mib,
        **counters,
    )
    # one sample a second: (seconds, usage MiB, working set MiB)
    r["memory_mib"] = [(round(t, 2), b / MIB, w / MIB) for t, b, w in run.memory[::10]]
    errors = sum(r["errors"].values())
    print(
        f"{system.name} x{scale:g} ({r['offered_rps']:.1f} req/s offered): SLO met "
        f"{(r['slo_attainment'] or 0) * 100:.1f}%, {errors} errors {r['errors']}, "
        f"{oom} OOM kills, peak {r['peak_memory_mib']:.0f}/{args.budget_mib:.0f} MiB "
        f"(working set {r['peak_working_set_mib']:.0f})",
        file=sys.stderr,
    )
    return r


async def run_system(
    name: str,
    trace: Trace,
    models: Sequence[BenchModel],
    slo_s: Sequence[float],
    args: argparse.Namespace,
) -> dict[str, Any]:
    system = SYSTEMS[name](args.workdir)

    async def at(scale: float) -> dict[str, Any]:
        return await run_rate(system, trace, models, slo_s, scale, args)

    if args.rate_scale:
        runs = [await at(s) for s in args.rate_scale]
        held = [r["scale"] for r in runs if (r["slo_attainment"] or 0) >= SLO_TARGET]
        scale = max(held) if held else None
    else:
        runs, scale = await search(at, args.start_scale, args.max_runs)
    base = len(trace.requests) / trace.duration_s
    # the headline figures come from the sustained run, else from the lowest rate tried
    pick = next((r for r in runs if r["scale"] == scale), None) or min(
        runs, key=lambda r: r["scale"]
    )
    return {
        "system": name,
        "sustainable_rate": None if scale is None else scale * base,
        "sustainable_scale": scale,
        "at_scale": pick["scale"],
        "errors": pick["errors"],
        "oom_kills": pick["oom_kills"],
        "oom_kills_all_rates": sum(r["oom_kills"] for r in runs),
        "peak_memory_mib": pick["peak_memory_mib"],
        "peak_working_set_mib": pick["peak_working_set_mib"],
        "budget_mib": args.budget_mib,
        "rates": sorted(runs, key=lambda r: r["scale"]),
    }


# ---- report ---------------------------------------------------------------------------------


def _f(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_markdown(doc: dict[str, Any]) -> str:
    t = doc["trace"]
    label = " (quick: a check, not a measurement)" if doc.get("quick") else ""
    parts = [
        f"Serverless trace{label}: {t['functions']} functions ({t['source']}), "
        f"{t['duration_s'] / 60:g} min, {t['requests']} requests ({t['rate_rps']:.2f} req/s at "
        f"scale 1); head {t['head_functions']} functions carry {t['head_share'] * 100:.0f}%; "
        f"{t['functions_invoked']} functions invoked; models {t['models_mib']:.0f} MiB "
        f"({t['model_mib_min']:.0f}-{t['model_mib_max']:.0f} MiB each) against a "
        f"{doc['budget_mib']:.0f} MiB cgroup limit; {doc['machine']}. SLO: max(1 s, 10x warm), "
        f"warm {doc['slo']['method']}; sustainable = at least {SLO_TARGET * 100:g}% within SLO."
    ]
    rows = [
        [
            s["system"],
            "-"
            if s["sustainable_rate"] is None
            else f"{s['sustainable_rate']:.2f} (x{s['sustainable_scale']:g})",
            f"x{s['at_scale']:g}",
            ", ".join(f"{n} {k}" for k, n in s["errors"].items()) or "0",
            f"{s['oom_kills']} ({s['oom_kills_all_rates']})",
            f"{s['peak_memory_mib']:.0f} ({s['peak_working_set_mib']:.0f}) / {s['budget_mib']:.0f}",
        ]
        for s in doc["systems"]
    ]
    parts.append(markdown_table(
        ["system", "sustainable req/s (scale)", "figures at", "errors", "OOM kills (all rates)",
         "peak (working set) / limit MiB"], rows))  # fmt: skip
    rows = []
    for s in doc["systems"]:
        for r in s["rates"]:
            h, tl = r["head"], r["tail"]
            rows.append([
                s["system"], f"x{r['scale']:g}", _f(r["offered_rps"], 1), r["requests"],
                _f((r["slo_attainment"] or 0) * 100, 1), _f(r["goodput_rps"], 1),
                f"{_f(h['p50_ms'])} / {_f(h['p99_ms'])} / {_f(h['p99.9_ms'])}",
                f"{_f(tl['p50_ms'])} / {_f(tl['p99_ms'])} / {_f(tl['p99.9_ms'])}",
                f"{r.get('cold_starts', '-')} ({_f(r.get('cold_start_mean_ms'))} ms)",
                ", ".join(f"{n} {k}" for k, n in r["errors"].items()) or "0",
                r["oom_kills"], f"{_f(r['peak_memory_mib'])} ({_f(r['peak_working_set_mib'])})",
            ])  # fmt: skip
    parts.append(markdown_table(
        ["system", "scale", "offered req/s", "requests", "SLO met %", "goodput req/s",
         "head p50/p99/p99.9 ms", "tail p50/p99/p99.9 ms", "cold starts (mean)", "errors",
         "OOM kills", "peak (working set) MiB"], rows))  # fmt: skip
    parts.extend(f"Note: {n}" for n in doc.get("notes", []))
    return "\n\n".join(parts) + "\n"


def render_figure(doc: dict[str, Any], path: Path) -> str | None:
    """Latency CDF per system and memory over time against the limit, at each system's
    headline rate; why not, or None."""
    try:
        import matplotlib
    except ImportError:
        return "no figure: matplotlib is not installed"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, mem) = plt.subplots(1, 2, figsize=(11, 4))
    for s in doc["systems"]:
        r = next(r for r in s["rates"] if r["scale"] == s["at_scale"])
        label = f"{s['system']} (x{r['scale']:g})"
        q = r["latency_cdf_ms"]
        if q:
            cdf.plot(q, [i / (len(q) - 1) for i in range(len(q))], label=label)
        if r["memory_mib"]:
            ts, usage, working = zip(*r["memory_mib"], strict=True)
            (line,) = mem.plot(ts, usage, label=f"{label}: usage")
            mem.plot(ts, working, color=line.get_color(), linestyle=":",
                     label=f"{label}: working set")  # fmt: skip
    cdf.set_xscale("log")
    cdf.set_xlabel("latency of answered requests (ms)")
    cdf.set_ylabel("share of requests")
    cdf.legend()
    mem.axhline(doc["budget_mib"], color="k", linestyle="--", label="cgroup limit")
    mem.set_xlabel("seconds into the replay")
    mem.set_ylabel("cgroup memory (MiB)")
    mem.legend()
    fig.suptitle("serverless trace" + (" (quick)" if doc.get("quick") else ""))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ---- main -----------------------------------------------------------------------------------


def default_budget_mib(trace: Trace) -> float:
    """The memory limit every system gets unless ``--budget-mib`` says: a quarter of the
    models, so they together need at least four times what the node has."""
    return trace.models_bytes / MIB / 4


def build_trace(args: argparse.Namespace) -> Trace:
    if args.trace is not None:
        return read_trace(args.trace)
    params = TraceParams(
        functions=args.functions, minutes=args.minutes, rate_rps=args.rate,
        total_mib=args.total_mib, min_mib=args.min_mib, max_mib=args.max_mib, seed=args.seed,
    )  # fmt: skip
    return azure(args.azure, params) if args.azure is not None else synthetic(params)


async def run_all(trace: Trace, args: argparse.Namespace) -> dict[str, Any]:
    models = write_models(trace, args.models_dir)
    evict_page_cache([args.models_dir])
    slo = calibrate(models)
    slo_s = [max(SLO_FLOOR_S, SLO_FACTOR * slo["warm_s"][f.name]) for f in trace.functions]
    systems = [await run_system(name, trace, models, slo_s, args) for name in args.systems]
    slo["slo_s"] = {f.name: s for f, s in zip(trace.functions, slo_s, strict=True)}
    return {"slo": slo, "systems": systems}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = TraceParams()
    p.add_argument("--functions", type=int, default=d.functions)
    p.add_argument("--minutes", type=float, default=d.minutes)
    p.add_argument("--rate", type=float, default=d.rate_rps, help="req/s at rate scale 1")
    p.add_argument("--total-mib", type=float, default=d.total_mib, help="all models together")
    p.add_argument("--min-mib", type=float, default=d.min_mib)
    p.add_argument("--max-mib", type=float, default=d.max_mib)
    p.add_argument("--budget-mib", type=float, help="the cgroup limit (default: total / 4)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--azure", type=Path, help="replay an Azure Functions 2019 per-minute CSV")
    p.add_argument("--trace", type=Path, help="replay a trace --write-trace wrote")
    p.add_argument("--write-trace", type=Path, help="write the trace here (and run nothing "
                   "unless --systems is given)")  # fmt: skip
    p.add_argument("--systems", help=f"comma-separated, of: {', '.join(SYSTEMS)} (default all)")
    p.add_argument("--rate-scale", help="comma-separated scales to run instead of the search")
    p.add_argument("--start-scale", type=float, default=1.0, help="where the search starts")
    p.add_argument("--max-runs", type=int, default=5, help="rate runs per system at most")
    p.add_argument("--run-seconds", type=float, default=90.0,
                   help="seconds of the scaled trace one rate replays at most")  # fmt: skip
    p.add_argument("--warmup-seconds", type=float, default=15.0,
                   help="of each replay: sent, not measured (at most a third)")  # fmt: skip
    p.add_argument("--client-timeout", type=float, default=120.0)
    p.add_argument("--models-dir", type=Path, default=Path("/tmp/trims-serverless-models"),
                   help="model files, kept and reused across runs")  # fmt: skip
    p.add_argument("--workdir", type=Path, help="a new folder to work in and keep (logs)")
    p.add_argument("--quick", action="store_true", help="20 functions, 2 min, 2 GiB: a check")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--figure", type=Path, help="PNG (e.g. docs/img/serverless.png)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.quick:
        defaults = p.parse_args([])
        for key, value in QUICK.items():
            if getattr(args, key) == getattr(defaults, key):
                setattr(args, key, value)
    run_only_trace = args.write_trace is not None and args.systems is None
    args.systems = [s.strip() for s in (args.systems or ",".join(SYSTEMS)).split(",") if s]
    if unknown := set(args.systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    try:
        args.rate_scale = [float(s) for s in args.rate_scale.split(",")] if args.rate_scale else []
    except ValueError:
        p.error("--rate-scale takes comma-separated numbers, e.g. 1,2,4")
    if any(s <= 0 for s in args.rate_scale) or args.start_scale <= 0 or args.max_runs < 1:
        p.error("rate scales must be above 0 and --max-runs at least 1")
    try:
        trace = build_trace(args)
    except (ValueError, OSError) as e:
        p.error(str(e))
    if args.write_trace is not None:
        write_trace(trace, args.write_trace)
        if run_only_trace:
            print(json.dumps(describe(trace), indent=2))
            return 0
    if args.budget_mib is None:
        args.budget_mib = default_budget_mib(trace)
    if args.workdir is not None and args.workdir.exists():
        p.error(f"--workdir {args.workdir} exists; name a new folder")
    import uvloop

    where = machine()
    with tempfile.TemporaryDirectory(prefix="trims-serverless-") as tmp:
        args.workdir = args.workdir or Path(tmp)
        args.workdir.mkdir(parents=True, exist_ok=True)
        args.workdir.chmod(0o755)  # a root gateway runs function code as nobody: code lives here
        try:
            result = uvloop.run(run_all(trace, args))
        except CgroupUnavailable as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    head = trace.head()
    doc: dict[str, Any] = {
        "trace": {**describe(trace), "head": sorted(trace.functions[i].name for i in head)},
        "quick": args.quick,
        "machine": where,
        "budget_mib": args.budget_mib,
        "run_seconds": args.run_seconds,
        "slo": {k: v for k, v in result["slo"].items() if k not in ("warm_s",)},
        "systems": result["systems"],
        "notes": [],
    }
    if args.figure is not None and (why := render_figure(doc, args.figure)):
        doc["notes"].append(why)
    write_outputs(args.json, args.markdown, doc, render_markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
