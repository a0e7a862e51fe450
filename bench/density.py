"""Density and churn: instances of a big-model function at once, memory with and without the store.

    python bench/density.py [--model-mb 1000 --instances 4 --budget-gib 16 --json OUT.json]

1. Density. ``--instances`` instances of one function whose model is ``--model-mb`` MiB run at
   once, each having read every weight (as a forward pass does). Measured: the total PSS of
   the workers (plus the daemon, with the store), with the store (each instance maps the node's
   one copy) and without it (each instance loads its own copy from the file). From the
   per-instance cost, the number of instances that fit in ``--budget-gib`` follows.
2. Churn. ``--churn-models`` functions, each with its own ``--churn-mb`` MiB model, get requests
   whose function is drawn from a Zipf distribution (``--zipf`` exponent) for ``--seconds``;
   instances idle for ``--idle-s`` stop (memory pressure keeps few instances around), so the
   tail of the distribution keeps cold-starting instances. Both modes fork from the zygote;
   they differ only in where the weights come from. Measured: requests/s, p50/p99, cold starts.
"""

from __future__ import annotations

import argparse
import asyncio
import random
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
    pss_bytes,
    start_daemon,
    write_json,
    write_model,
)

HANDLER = """
import os
import time

def init(ctx):
    weights = ctx.models["weights"].numpy()
    ctx.state["weights"] = weights  # a function keeps its weights for every request
    ctx.state["checksum"] = sum(float(w.sum()) for w in weights.values())

def handler(request, ctx):
    if request.body.startswith(b"hold:"):
        time.sleep(float(request.body[5:]))
    return f"{os.getpid()} {ctx.state['checksum']}"
"""

MODES = {"store": "local", "no_store": "zygote-direct"}


def spec(
    name: str, model: str, path: Path, code: Path, executor: str, **scaling: Any
) -> dict[str, Any]:
    return {
        "name": name,
        "handler": "densefn:handler",
        "code_dir": str(code),
        "executor": executor,
        "models": [{"name": model, "alias": "weights", "source": str(path)}],
        "scaling": {"request_timeout_s": 600, **scaling},
    }


async def density(
    session: Any, url: str, code: Path, path: Path, n: int, daemon_pid: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, executor in MODES.items():
        name = f"dense-{mode.replace('_', '-')}"
        body = spec(name, "big", path, code, executor, max_instances=n, concurrency=1, queue_size=n)
        async with session.put(f"{url}/v1/functions/{name}", json=body) as r:
            assert r.status == 201, await r.text()

        async def hold(name: str = name) -> int:
            async with session.post(f"{url}/v1/functions/{name}/invoke", data=b"hold:2") as r:
                text = await r.text()
                assert r.status == 200, text
                return int(text.split()[0])

        pids = set(await asyncio.gather(*(hold() for _ in range(n))))
        workers = sum(pss_bytes(p) for p in pids)
        daemon = pss_bytes(daemon_pid) if mode == "store" else 0
        out[mode] = {"instances": len(pids), "workers_pss": workers, "daemon_pss": daemon,
                     "total_pss": workers + daemon}  # fmt: skip
        async with session.delete(f"{url}/v1/functions/{name}") as r:
            assert r.status == 200
        await asyncio.sleep(1.0)
        print(
            f"density {mode}: {len(pids)} instances, {(workers + daemon) / 2**20:.0f} MiB PSS",
            file=sys.stderr,
        )
    return out


async def _zipf_load(
    session: Any, url: str, names: list[str], weights: list[float], args: argparse.Namespace
) -> tuple[list[float], int]:
    rng = random.Random(7)
    latencies: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + args.seconds

    async def client() -> None:
        nonlocal errors
        while time.perf_counter() < stop_at:
            name = rng.choices(names, weights)[0]
            t0 = time.perf_counter()
            async with session.post(f"{url}/v1/functions/{name}/invoke") as r:
                await r.read()
                if r.status != 200:
                    errors += 1
                    continue
            latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    return latencies, errors


async def churn(
    session: Any, url: str, code: Path, paths: list[Path], args: argparse.Namespace
) -> dict[str, Any]:
    weights = [1 / (k + 1) ** args.zipf for k in range(len(paths))]
    out: dict[str, Any] = {}
    for mode, executor in MODES.items():
        names = [f"churn-{mode.replace('_', '-')}-{i}" for i in range(len(paths))]
        for i, name in enumerate(names):
            body = spec(name, f"m{i}", paths[i], code, executor, max_instances=2,
                        concurrency=1, idle_timeout_s=args.idle_s)  # fmt: skip
            async with session.put(f"{url}/v1/functions/{name}", json=body) as r:
                assert r.status == 201, await r.text()
        latencies, errors = await _zipf_load(session, url, names, weights, args)
        async with session.get(f"{url}/metrics") as r:
            metrics = await r.text()
        cold = sum(
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("trims_cold_starts_total")
            and f"churn-{mode.replace('_', '-')}-" in line
        )
        for name in names:
            async with session.delete(f"{url}/v1/functions/{name}") as r:
                assert r.status == 200
        latencies.sort()
        n = len(latencies)
        out[mode] = {
            "requests": n, "errors": errors, "rps": n / args.seconds, "cold_starts": cold,
            "p50_ms": latencies[n // 2] * 1e3 if n else None,
            "p99_ms": latencies[min(n - 1, int(n * 0.99))] * 1e3 if n else None,
        }  # fmt: skip
        print(f"churn {mode}: {out[mode]}", file=sys.stderr)
        await asyncio.sleep(1.0)
    return out


async def run(root: Path, store_socket: Path, daemon_pid: int, big: Path, small: list[Path],
              args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    import aiohttp

    code = root / "code"
    code.mkdir()
    (code / "densefn.py").write_text(HANDLER)
    timeout = aiohttp.ClientTimeout(total=900)
    async with (
        local_gateway(root, store_socket) as url,
        aiohttp.ClientSession(timeout=timeout) as session,
    ):
        return {
            "density": await density(session, url, code, big, args.instances, daemon_pid),
            "churn": await churn(session, url, code, small, args),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-mb", type=int, default=1000)
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--budget-gib", type=float, default=16.0)
    parser.add_argument("--churn-models", type=int, default=8)
    parser.add_argument("--churn-mb", type=int, default=100)
    parser.add_argument("--zipf", type=float, default=1.2)
    parser.add_argument("--idle-s", type=float, default=0.5)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import uvloop

    from trims.runtime.client import StoreClient

    where = machine()
    budget_mib = args.model_mb + args.churn_models * args.churn_mb + 512
    with tempfile.TemporaryDirectory(prefix="trims-bench-density-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)  # a root gateway runs function code as nobody: code dirs live here
        daemon, store_socket = start_daemon(root, cpu_budget=f"{budget_mib}MiB")
        try:
            big = root / "big.safetensors"
            write_model(big, args.model_mb)
            small = []
            with StoreClient(store_socket) as client:
                client.add("big", big)
                client.load("big", tier="cpu")
                for i in range(args.churn_models):
                    path = root / f"m{i}.safetensors"
                    write_model(path, args.churn_mb, seed=i)
                    client.add(f"m{i}", path)
                    client.load(f"m{i}", tier="cpu")
                    small.append(path)
            result = uvloop.run(run(root, store_socket, daemon.proc.pid, big, small, args))
        finally:
            daemon.stop()
    dens = result["density"]
    budget = args.budget_gib * 2**30
    model_bytes = args.model_mb << 20
    for mode, d in dens.items():
        if mode == "store":
            # one shared copy, plus what each instance adds (daemon overhead charged to them)
            fixed, marginal = model_bytes, max(1.0, (d["total_pss"] - model_bytes) / d["instances"])
        else:
            fixed, marginal = 0, d["total_pss"] / d["instances"]
        d["marginal_mib"] = round(marginal / 2**20, 1)
        d["instances_in_budget"] = int(max(0.0, budget - fixed) // marginal)
    knobs = ("churn_models", "churn_mb", "zipf", "idle_s", "seconds", "concurrency")
    result.update(
        model_mb=args.model_mb,
        budget_gib=args.budget_gib,
        machine=where,
        churn_settings={k: getattr(args, k) for k in knobs},
    )
    write_json(args.json, result)
    print(markdown_table(
        ["mode", "instances", "total PSS MiB", "MiB per added instance",
         f"instances in {args.budget_gib:g} GiB"],
        [[m, d["instances"], f"{d['total_pss'] / 2**20:.0f}", d["marginal_mib"],
          d["instances_in_budget"]] for m, d in dens.items()],
    ))  # fmt: skip
    print()
    print(markdown_table(
        ["mode", "req/s", "p50 ms", "p99 ms", "cold starts", "errors"],
        [[m, f"{c['rps']:.1f}", f"{c['p50_ms']:.1f}", f"{c['p99_ms']:.1f}",
          int(c["cold_starts"]), c["errors"]] for m, c in result["churn"].items()],
    ))  # fmt: skip
    print(f"\n({where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
