"""Cold start: from invoking a function with zero instances to its response, through the gateway.

    python bench/coldstart.py --model-mb 100,1000 --runs 5 --json OUT.json

Modes (one function per run, deployed fresh so it has no instance; its model is a
``--model-mb`` safetensors file of float32 tensors):

* ``no_store``: a fresh interpreter (no zygote) loads the weights from local disk itself. The
  file is evicted from the page cache before each run (``posix_fadvise(DONTNEED)``), as on a
  node that has not read it recently; ``--keep-page-cache`` skips that.
* ``store``: a fresh interpreter acquires the model from the daemon (CPU tier, already hot).
* ``store_zygote``: the default local executor: a worker forked from the zygote (numpy, torch
  and onnxruntime imported) acquires the model from the daemon.
* ``standby``: as ``store_zygote``, but the function keeps a standby instance
  (``scaling.standby: 1``), prepared before the clock starts: the request activates it and
  only ``init`` runs (Note [standby instances] in trims.runtime.gateway.pool).
* ``warm``: the next request to that running instance.
* with ``--docker``, ``docker`` and ``docker_standby``: the same in containers of the runtime
  image (``trims-runtime:latest``, built by ``dockerfiles/build-image.sh``), the daemon's
  socket mounted.

With ``--handler touch`` (the default) the handler's init maps the weights and its request
reads the first 4 KiB of one tensor, so a run measures start, acquire and one request, not a
forward pass over all the weights. ``--handler full`` makes every request a full pass: a
matrix-vector product over every tensor, so the first request pays for faulting in all the
weights, as a real model's does.

Each cold row also splits the time into ``start`` (the instance start the gateway observed:
its ``trims_cold_start_seconds`` metric for that function) and ``request`` (the rest: the first
request, through the gateway). JSON: ``{"results": [{"mode", "model_mb", "median_s", "min_s",
"max_s", "start_median_s", "request_median_s"}], "handler", ...}`` (the split is null for
``warm``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trims.tables import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_common import (
    local_gateway,
    machine,
    parse_metric,
    pid_alive,
    start_daemon,
    summary,
    write_json,
    write_model,
)

MODES = ("no_store", "store", "store_zygote", "standby", "warm")
DOCKER_MODES = ("docker", "docker_standby")
EXECUTOR_OF = {
    "no_store": "spawn-direct",
    "store": "spawn-store",
    "store_zygote": "local",
    "standby": "local",
    "docker": "docker",
    "docker_standby": "docker",
}
#: modes whose function keeps a standby instance (prepared, untimed, before the request)
STANDBY_MODES = ("standby", "docker_standby")

HANDLERS = {
    "touch": """
import os

def init(ctx):
    weights = ctx.models["weights"].numpy()
    ctx.state["first"] = weights[sorted(weights)[0]]

def handler(request, ctx):
    first = ctx.state["first"]
    return f"{float(first[:1024].sum())} {os.getpid()}"
""",
    "full": """
import os

import numpy as np

def init(ctx):
    ctx.state["weights"] = list(ctx.models["weights"].numpy().values())

def handler(request, ctx):
    total = 0.0
    for w in ctx.state["weights"]:
        flat = w.reshape(-1)
        rows = flat[: flat.size // 1024 * 1024].reshape(-1, 1024)
        total += float((rows @ np.ones(1024, dtype=w.dtype)).sum()) + float(flat[rows.size :].sum())
    return f"{total} {os.getpid()}"
""",
}


def evict_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


async def instance_start_s(session: Any, url: str, name: str) -> float | None:
    """How long the gateway took to start ``name``'s instance (its cold-start metric)."""
    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    return parse_metric(text, "trims_cold_start_seconds_sum", {"function": name})


async def run_modes(
    root: Path,
    store_socket: Path,
    models: dict[int, Path],
    runs: int,
    keep_cache: bool,
    handler: str = "touch",
    cold_modes: tuple[str, ...] = ("no_store", "store", "store_zygote", "standby"),
) -> tuple[dict[tuple[str, int], list[float]], dict[tuple[str, int], list[float]]]:
    """Times per (mode, size) of the first response, and of its instance's start."""
    import aiohttp

    code = root / "code"
    code.mkdir()
    (code / "coldfn.py").write_text(HANDLERS[handler])
    times: dict[tuple[str, int], list[float]] = {}
    starts: dict[tuple[str, int], list[float]] = {}
    async with local_gateway(root, store_socket) as url, aiohttp.ClientSession() as session:
        for mb, path in models.items():
            for run in range(runs):
                for mode in cold_modes:
                    name = f"cs-{mode.replace('_', '-')}-{mb}-{run}"
                    standby = int(mode in STANDBY_MODES)
                    spec = {
                        "name": name,
                        "handler": "coldfn:handler",
                        "code_dir": str(code),
                        "executor": EXECUTOR_OF[mode],
                        "models": [{"name": f"w{mb}", "alias": "weights", "source": str(path)}],
                        "scaling": {
                            "max_instances": 1, "request_timeout_s": 300, "standby": standby,
                        },
                    }  # fmt: skip
                    async with session.put(f"{url}/v1/functions/{name}", json=spec) as r:
                        assert r.status == 201, await r.text()
                    if standby:
                        await standby_prepared(session, url, name)
                    if mode == "no_store" and not keep_cache:
                        evict_page_cache(path)
                    t0 = time.perf_counter()
                    async with session.post(f"{url}/v1/functions/{name}/invoke") as r:
                        body = await r.text()
                    elapsed = time.perf_counter() - t0
                    assert r.status == 200, body
                    times.setdefault((mode, mb), []).append(elapsed)
                    start = await instance_start_s(session, url, name)
                    if start is not None:
                        starts.setdefault((mode, mb), []).append(start)
                    if mode == "store_zygote":
                        t0 = time.perf_counter()
                        async with session.post(f"{url}/v1/functions/{name}/invoke") as r:
                            await r.read()
                        times.setdefault(("warm", mb), []).append(time.perf_counter() - t0)
                    pid = int(body.split()[1])
                    async with session.delete(f"{url}/v1/functions/{name}") as r:
                        assert r.status == 200
                    if mode in DOCKER_MODES:  # the pid is the container's own namespace's
                        await containers_gone(name)
                    else:
                        while pid_alive(pid):
                            await asyncio.sleep(0.02)
                    print(
                        f"{mode:>13} {mb:>5} MB run {run}: {elapsed * 1e3:8.1f} ms",
                        file=sys.stderr,
                    )
    return times, starts


async def containers_gone(function: str) -> None:
    """Wait until no container of ``function`` is left (its instances stopped)."""
    import docker

    from trims.runtime.executors.docker import LABEL_FUNCTION

    client = docker.from_env()
    try:
        selector = {"label": f"{LABEL_FUNCTION}={function}"}
        while await asyncio.to_thread(
            client.containers.list, all=True, sparse=True, filters=selector
        ):
            await asyncio.sleep(0.05)
    finally:
        client.close()


async def standby_prepared(session: Any, url: str, name: str, limit_s: float = 300.0) -> None:
    """Poll ``name`` until its standby says it is prepared (not timed)."""
    deadline = time.monotonic() + limit_s
    while True:
        async with session.get(f"{url}/v1/functions/{name}") as r:
            doc = await r.json()
        if any(i.get("prepared") for i in doc["status"]["instances"]):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the standby of {name} was not prepared in {limit_s:g} s: {doc}")
        await asyncio.sleep(0.02)


def plot(results: list[dict[str, Any]], sizes: list[int], path: Path) -> None:
    """Grouped bars of the median cold start per mode and model size, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        medians = [
            next(r["median_s"] for r in results if r["mode"] == mode and r["model_mb"] == mb) * 1e3
            for mb in sizes
        ]
        ax.bar([x + i * width for x in range(len(sizes))], medians, width, label=mode)
    ax.set_xticks([x + width * (len(MODES) - 1) / 2 for x in range(len(sizes))])
    ax.set_xticklabels([f"{mb} MB model" for mb in sizes])
    ax.set_yscale("log")
    ax.set_ylabel("time to first response, ms (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def split(
    times: dict[tuple[str, int], list[float]],
    starts: dict[tuple[str, int], list[float]],
    mode: str,
    mb: int,
) -> dict[str, float | None]:
    """Median instance start, and median of (first response - start), of one mode and size."""
    import statistics

    begun = starts.get((mode, mb), [])
    if len(begun) != len(times[(mode, mb)]):
        return {"start_median_s": None, "request_median_s": None}
    return {
        "start_median_s": statistics.median(begun),
        "request_median_s": statistics.median(
            t - s for t, s in zip(times[(mode, mb)], begun, strict=True)
        ),
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-mb", default="100,1000", help="comma-separated model sizes")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep-page-cache", action="store_true")
    parser.add_argument(
        "--handler",
        choices=sorted(HANDLERS),
        default="touch",
        help="touch: read 4 KiB of the weights per request; full: read all of them",
    )
    parser.add_argument("--plot", type=Path, help="also draw the medians (PNG or SVG) here")
    parser.add_argument(
        "--docker",
        action="store_true",
        help="also the docker and docker_standby modes (needs dockerd and trims-runtime:latest)",
    )
    parser.add_argument(
        "--cpu-backing",
        choices=("auto", "memfd", "file"),
        default="auto",
        help="the daemon's --cpu-backing: sealed memfds or the disk files in the page cache",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.model_mb.split(",") if s]

    import uvloop

    from trims.runtime.client import StoreClient

    where = machine()
    with tempfile.TemporaryDirectory(prefix="trims-bench-cold-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)  # a root gateway runs function code as nobody: code dirs live here
        daemon, store_socket = start_daemon(
            root, cpu_budget=f"{sum(sizes) * 2 + 512}MiB", cpu_backing=args.cpu_backing
        )
        try:
            models = {}
            with StoreClient(store_socket) as client:
                for mb in sizes:
                    path = root / f"w{mb}.safetensors"
                    write_model(path, mb)
                    client.add(f"w{mb}", path)
                    client.load(f"w{mb}", tier="cpu")
                    models[mb] = path
            cold = tuple(m for m in MODES if m != "warm") + (DOCKER_MODES if args.docker else ())
            times, starts = uvloop.run(
                run_modes(root, store_socket, models, args.runs, args.keep_page_cache,
                          args.handler, cold)
            )  # fmt: skip
        finally:
            daemon.stop()
    results = [
        {
            "mode": mode,
            "model_mb": mb,
            **summary(times[(mode, mb)]),
            **split(times, starts, mode, mb),
        }
        for mb in sizes
        for mode in MODES + (DOCKER_MODES if args.docker else ())
    ]
    by = {(r["mode"], r["model_mb"]): r["median_s"] for r in results}
    speedups = {str(mb): by[("no_store", mb)] / by[("store_zygote", mb)] for mb in sizes}
    write_json(
        args.json,
        {"results": results, "speedup_store_zygote_vs_no_store": speedups, "runs": args.runs,
         "page_cache_evicted": not args.keep_page_cache, "handler": args.handler,
         "machine": where},
    )  # fmt: skip
    rows = [
        [r["mode"], r["model_mb"], f"{r['median_s'] * 1e3:.1f}", f"{r['min_s'] * 1e3:.1f}",
         f"{r['max_s'] * 1e3:.1f}", _ms(r["start_median_s"]), _ms(r["request_median_s"])]
        for r in results
    ]  # fmt: skip
    print(f"handler: {args.handler}")
    print(markdown_table(["mode", "model MB", "median ms", "min ms", "max ms", "start ms",
                          "first request ms"], rows))  # fmt: skip
    if args.plot is not None:
        plot(results, sizes, args.plot)
    for size, speedup in speedups.items():
        print(f"\nstore_zygote vs no_store at {size} MB: {speedup:.1f}x faster ({where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
