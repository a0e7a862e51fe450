"""Gateway throughput: the echo function through the gateway beside a bare aiohttp hello-world.

    python bench/gateway.py --concurrency 16 --seconds 10 --json OUT.json

Both servers run as their own processes and are loaded by the same load generator, itself a
separate process (aiohttp on uvloop, keep-alive connections, ``--concurrency`` requests in
flight, the first second discarded as warm-up). The echo function is ``examples/echo`` on the
local executor: every request goes client -> gateway -> worker (Unix socket) -> gateway ->
client, where the bare server answers directly. The pair is measured ``--repeat`` times,
alternating, and medians are reported (the ratio is of the median rates). Writes
``{"echo_rps", "echo_p50_ms", "echo_p99_ms", "bare_rps", ...}`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trims.tables import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_common import (
    REPO,
    cpu_seconds,
    machine,
    start,
    start_gateway,
    tree_pids,
    write_json,
)

BODY = b"hello"


def serve_bare() -> None:
    """A hello-world aiohttp server on uvloop; prints its port."""
    import uvloop
    from aiohttp import web

    async def hello(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"hello", content_type="text/plain")

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/", hello)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        print(f"bare ready port={runner.addresses[0][1]}", file=sys.stderr, flush=True)
        await asyncio.Event().wait()

    uvloop.run(main())


async def _load(url: str, concurrency: int, seconds: float, warmup_s: float) -> dict[str, Any]:
    import aiohttp

    latencies: list[float] = []
    errors = 0
    start = time.perf_counter()
    measure_from = start + warmup_s
    stop_at = measure_from + seconds
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal errors
            while True:
                t0 = time.perf_counter()
                if t0 >= stop_at:
                    return
                async with session.post(url, data=BODY) as r:
                    await r.read()
                    ok = r.status == 200
                t1 = time.perf_counter()
                if t0 >= measure_from:
                    if ok:
                        latencies.append(t1 - t0)
                    else:
                        errors += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    latencies.sort()
    n = len(latencies)
    return {
        "requests": n,
        "errors": errors,
        "rps": n / seconds,
        "p50_ms": latencies[n // 2] * 1e3 if n else None,
        "p99_ms": latencies[min(n - 1, int(n * 0.99))] * 1e3 if n else None,
    }


def loadgen(url: str, concurrency: int, seconds: float) -> None:
    import uvloop

    print(json.dumps(uvloop.run(_load(url, concurrency, seconds, 1.0))))


def measure(url: str, concurrency: int, seconds: float, server_pid: int) -> dict[str, Any]:
    """Load ``url``; also the CPU the server's process tree spent per request."""
    pids = tree_pids(server_pid)
    before = cpu_seconds(pids)
    out = subprocess.run(
        [sys.executable, __file__, "--loadgen", url, "--concurrency", str(concurrency),
         "--seconds", str(seconds)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(out.stdout)
    after = cpu_seconds(pids)
    spent = sum(after[p] - before.get(p, 0.0) for p in after)
    total = result["requests"] * (1 + 1 / seconds)  # the warm-up second is served too
    result["server_cpu_ms_per_request"] = spent / total * 1e3 if total else None
    return result


def deploy_echo(url: str) -> None:
    import urllib.request

    sys.path.insert(0, str(REPO))
    from trims.runtime.functions.spec import load_spec_file

    spec = load_spec_file(REPO / "examples" / "echo" / "function.yaml")
    req = urllib.request.Request(
        f"{url}/v1/functions/{spec.name}",
        data=json.dumps(spec.to_dict()).encode(),
        headers={"Content-Type": "application/json"},
        method="PUT",
    )
    urllib.request.urlopen(req, timeout=60).read()
    invoke = urllib.request.Request(f"{url}/v1/functions/echo/invoke", data=BODY, method="POST")
    assert urllib.request.urlopen(invoke, timeout=120).read() == BODY


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=3, help="alternating runs; medians reported")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--serve-bare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loadgen", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_bare:
        serve_bare()
        return 0
    if args.loadgen:
        loadgen(args.loadgen, args.concurrency, args.seconds)
        return 0

    with tempfile.TemporaryDirectory(prefix="trims-bench-gw-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)  # a root gateway runs function code as nobody: code dirs live here
        where = machine()
        bare = start([sys.executable, __file__, "--serve-bare"], root / "bare.log", r"port=(\d+)")
        gateway, url = start_gateway(
            root, "--preload", "numpy", "--store-socket", str(root / "none")
        )
        try:
            deploy_echo(url)
            bare_url = f"http://127.0.0.1:{bare.match.group(1)}/"
            echo_url = f"{url}/v1/functions/echo/invoke"
            pairs = []
            for _ in range(args.repeat):  # alternate, so both see the same background load
                b = measure(bare_url, args.concurrency, args.seconds, bare.proc.pid)
                e = measure(echo_url, args.concurrency, args.seconds, gateway.proc.pid)
                pairs.append((e, b))
        finally:
            gateway.stop()
            bare.stop()

    def med(side: int, key: str) -> float:
        return statistics.median(p[side][key] for p in pairs)

    doc: dict[str, Any] = {}
    for side, name in ((0, "echo"), (1, "bare")):
        for key in ("rps", "p50_ms", "p99_ms"):
            doc[f"{name}_{key}"] = med(side, key)
        doc[f"{name}_cpu_ms_per_request"] = med(side, "server_cpu_ms_per_request")
    doc.update(
        ratio=doc["echo_rps"] / doc["bare_rps"],
        ratios=[e["rps"] / b["rps"] for e, b in pairs],
        errors=sum(e["errors"] + b["errors"] for e, b in pairs),
        concurrency=args.concurrency,
        seconds=args.seconds,
        repeat=args.repeat,
        machine=where,
    )
    write_json(args.json, doc)
    rows = [
        [label, f"{doc[k + '_rps']:.0f}", f"{doc[k + '_p50_ms']:.2f}", f"{doc[k + '_p99_ms']:.2f}",
         f"{doc[k + '_cpu_ms_per_request']:.3f}"]
        for label, k in (("echo via gateway (gateway + worker)", "echo"), ("bare aiohttp", "bare"))
    ]  # fmt: skip
    table = markdown_table(["server", "req/s", "p50 ms", "p99 ms", "server CPU ms/request"], rows)
    ratios = ", ".join(f"{r:.2f}" for r in doc["ratios"])
    print(f"{table}\n\necho / bare = {doc['ratio']:.2f} (runs: {ratios}; {where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
