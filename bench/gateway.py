"""Gateway throughput: the echo function through the gateway beside a bare aiohttp hello-world.

    python bench/gateway.py --concurrency 16 --seconds 10 --json OUT.json

Both servers run as their own processes and are loaded by the same load generator, itself a
separate process (aiohttp on uvloop, keep-alive connections, the first second discarded as
warm-up). The echo function is ``examples/echo`` on the local executor: every request goes
client -> gateway -> worker (Unix socket) -> gateway -> client, where the bare server answers
directly. Between the two, a minimal proxy (``proxy``): one aiohttp route on uvloop that sends
each request's body and headers to the same echo worker over its own connection (the gateway's
wire protocol and client) and answers with the reply: the floor of this design (an HTTP server
plus a round trip to a worker process) without the gateway's routing table, middlewares, auth,
pool, queue and metrics. Beside the gateway, a second one started with ``--no-fast-path``
(``echo_web``): the same invocation answered through aiohttp's web layer instead of the invoke
fast path (Note [invoke fast path] in ``runtime/gateway/fastpath.py``), so the fast path's gain
is measured in the same run. The servers are measured ``--repeat`` times, alternating, and
medians are reported (the ratios are of the median rates).

Two load shapes (``--modes closed,open``, both by default):

* closed loop: ``--concurrency`` requests in flight, each sent when the previous answered;
  latency from sending to the answer. This measures capacity, but a slow answer also delays
  the requests behind it, so its tail understates what users see (coordinated omission).
* open loop: requests fired on a fixed schedule (``--open-rate`` req/s, or by default
  ``--open-fraction`` of the closed-loop rate the same server reached in the same repeat),
  whether or not earlier ones have answered; latency from each request's *scheduled* time,
  so time queued anywhere, the load generator included, counts. Reported beside the closed
  loop as ``{server}_open_offered_rps``, ``_rps``, ``_p50_ms``, ``_p99_ms`` and
  ``_send_lag_p99_ms`` (how late the load generator itself sent; a single Python process
  cannot keep a schedule near its own capacity, and the output says when that happened).

Writes ``{"echo_rps", "echo_p50_ms", "echo_p99_ms", "bare_rps", "proxy_rps", "echo_web_rps",
..., "ratio", "proxy_ratio", "web_ratio"}`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from trims.tables import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_common import (
    REPO,
    closed_loop,
    cpu_seconds,
    machine,
    open_loop,
    start,
    start_gateway,
    tree_pids,
    write_json,
)

BODY = b"hello"


async def _serve_post(name: str, handler: Any) -> None:
    """Serve ``handler`` on ``POST /`` (aiohttp, no access log) and print ``{name} ready
    port=N``; runs until killed."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
    await site.start()
    print(f"{name} ready port={runner.addresses[0][1]}", file=sys.stderr, flush=True)
    await asyncio.Event().wait()


def serve_bare() -> None:
    """A hello-world aiohttp server on uvloop; prints its port."""
    import uvloop
    from aiohttp import web

    async def hello(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"hello", content_type="text/plain")

    uvloop.run(_serve_post("bare", hello))


def serve_proxy(worker: str) -> None:
    """The minimal proxy to the echo worker at ``worker`` (``unix:PATH``); prints its port."""
    import uvloop
    from aiohttp import web

    from trims.runtime.gateway.service import forwarded_headers
    from trims.runtime.wire import META_HEADERS, META_STATUS, Kind
    from trims.runtime.worker.client import WorkerConnection, raise_for_error

    async def main() -> None:
        conn = await WorkerConnection.open(worker)
        await conn.hello()

        async def forward(request: web.Request) -> web.Response:
            body = await request.read()
            headers = forwarded_headers(request.headers)
            frame = await conn.request(Kind.INVOKE, {META_HEADERS: headers}, body, 30.0)
            raise_for_error(frame)
            meta = frame.meta
            return web.Response(
                status=meta.get(META_STATUS, 200), headers=meta.get(META_HEADERS), body=frame.body
            )

        await _serve_post("proxy", forward)

    uvloop.run(main())


def echo_worker(gateway_pid: int) -> tuple[str, int]:
    """The address the echo worker (a process under the gateway) listens on, and its pid."""
    import psutil

    for pid in tree_pids(gateway_pid)[1:]:
        for conn in psutil.Process(pid).net_connections("unix"):
            if conn.laddr and conn.laddr.endswith(".sock"):  # its socket file (the worker binds)
                return f"unix:{conn.laddr}", pid
    raise RuntimeError("the echo worker's socket was not found under the gateway")


async def _load(url: str, concurrency: int, seconds: float, rate: float | None) -> dict[str, Any]:
    """A closed loop of ``concurrency`` clients, or an open loop at ``rate`` req/s."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=max(64, concurrency) if rate else concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def send() -> bool:
            try:
                async with session.post(url, data=BODY) as r:
                    await r.read()
                    return r.status == 200
            except aiohttp.ClientError:
                return False

        if rate is None:
            return await closed_loop(send, concurrency, seconds)
        return await open_loop(send, rate, seconds)


#: An open-loop run whose requests left later than this (p99, ms) is flagged in the output:
#: twice the 1 ms resolution of uvloop's timers, which delays some sends by design.
LATE_MS = 2.0


def loadgen(url: str, concurrency: int, seconds: float, rate: float | None) -> None:
    import uvloop

    print(json.dumps(uvloop.run(_load(url, concurrency, seconds, rate))))


def measure(
    url: str, concurrency: int, seconds: float, servers: list[int], rate: float | None = None
) -> dict[str, Any]:
    """Load ``url`` (closed loop, or open loop at ``rate`` req/s); also the CPU the process
    trees of ``servers`` spent per request."""
    pids = [pid for root in servers for pid in tree_pids(root)]
    before = cpu_seconds(pids)
    open_loop = ["--open-rate", str(rate)] if rate is not None else []
    out = subprocess.run(
        [sys.executable, __file__, "--loadgen", url, "--concurrency", str(concurrency),
         "--seconds", str(seconds), *open_loop],
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


MODES = ("closed", "open")
SERVERS = ("echo", "echo_web", "proxy", "bare")


def parse_modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"--modes {text!r}: give closed, open or closed,open (unknown: {', '.join(unknown)})"
        )
    return modes


def run_pair(
    urls: dict[str, str], pids: dict[str, list[int]], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """One repeat: each server in each mode, bare first; ``{"echo": ..., "echo_open": ...}``."""
    out: dict[str, dict[str, Any]] = {}
    for server in ("bare", "proxy", "echo", "echo_web"):
        if "closed" in args.modes:
            out[server] = measure(urls[server], args.concurrency, args.seconds, pids[server])
    for server in ("bare", "proxy", "echo", "echo_web"):
        if "open" in args.modes:
            rate = args.open_rate or args.open_fraction * out[server]["rps"]
            out[f"{server}_open"] = measure(
                urls[server], args.concurrency, args.seconds, pids[server], max(rate, 1.0)
            )
    return out


def summarize_runs(
    runs: list[dict[str, dict[str, Any]]], args: argparse.Namespace
) -> dict[str, Any]:
    """Medians over the repeats, flat: ``echo_rps``, ``bare_open_p99_ms``, ... and the ratios."""

    def med(run: str, key: str) -> float | None:
        values = [r[run][key] for r in runs if r[run][key] is not None]
        return statistics.median(values) if values else None

    doc: dict[str, Any] = {"modes": list(args.modes)}
    keys = ("rps", "p50_ms", "p99_ms", "server_cpu_ms_per_request")
    for server in SERVERS:
        if "closed" in args.modes:
            for key in keys:
                doc[f"{server}_{key}"] = med(server, key)
        if "open" in args.modes:
            for key in ("offered_rps", *keys, "send_lag_p99_ms"):
                doc[f"{server}_open_{key}"] = med(f"{server}_open", key)
    if "closed" in args.modes:
        doc["ratio"] = doc["echo_rps"] / doc["bare_rps"]
        doc["ratios"] = [r["echo"]["rps"] / r["bare"]["rps"] for r in runs]
        doc["proxy_ratio"] = doc["proxy_rps"] / doc["bare_rps"]
        doc["proxy_ratios"] = [r["proxy"]["rps"] / r["bare"]["rps"] for r in runs]
        doc["web_ratio"] = doc["echo_web_rps"] / doc["bare_rps"]
        doc["web_ratios"] = [r["echo_web"]["rps"] / r["bare"]["rps"] for r in runs]
    if "open" in args.modes:
        doc["open_fraction"] = None if args.open_rate else args.open_fraction
        doc["open_rate"] = args.open_rate
    doc.update(
        errors=sum(m["errors"] for r in runs for m in r.values()),
        concurrency=args.concurrency,
        seconds=args.seconds,
        repeat=args.repeat,
    )
    return doc


def table(doc: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    rows = []
    for server, label in (
        ("echo", "echo via gateway (gateway + worker)"),
        ("echo_web", "echo via gateway, --no-fast-path (gateway + worker)"),
        ("proxy", "minimal proxy to the same worker (proxy + worker)"),
        ("bare", "bare aiohttp"),
    ):
        if f"{server}_rps" in doc:
            closed = f"closed, c={doc['concurrency']}"
            rows.append([label, closed, "-", f"{doc[server + '_rps']:.0f}",
                         ms(doc[f"{server}_p50_ms"]), ms(doc[f"{server}_p99_ms"]),
                         f"{doc[server + '_server_cpu_ms_per_request']:.3f}"])  # fmt: skip
        if f"{server}_open_rps" in doc:
            p = f"{server}_open_"
            rows.append([label, "open", f"{doc[p + 'offered_rps']:.0f}", f"{doc[p + 'rps']:.0f}",
                         ms(doc[p + "p50_ms"]), ms(doc[p + "p99_ms"]),
                         f"{doc[p + 'server_cpu_ms_per_request']:.3f}"])  # fmt: skip
    head = ["server", "load", "offered req/s", "req/s", "p50 ms", "p99 ms", "server CPU ms/request"]
    return markdown_table(head, rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=3, help="alternating runs; medians reported")
    parser.add_argument("--modes", type=parse_modes, default=MODES,
                        help="closed, open or closed,open (default both)")  # fmt: skip
    parser.add_argument("--open-fraction", type=float, default=0.8,
                        help="open-loop rate as a fraction of the same server's closed-loop "
                        "rate in the same repeat (default 0.8)")  # fmt: skip
    parser.add_argument("--open-rate", type=float, default=None,
                        help="open-loop rate in req/s for both servers, instead of the "
                        "fraction")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--serve-bare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-proxy", metavar="WORKER", help=argparse.SUPPRESS)
    parser.add_argument("--loadgen", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_bare:
        serve_bare()
        return 0
    if args.serve_proxy:
        serve_proxy(args.serve_proxy)
        return 0
    if args.loadgen:
        loadgen(args.loadgen, args.concurrency, args.seconds, args.open_rate)
        return 0
    if "closed" not in args.modes and args.open_rate is None:
        parser.error("--modes open alone needs --open-rate (the fraction is of a closed-loop rate)")
    if args.open_rate is not None and args.open_rate <= 0:
        parser.error(f"--open-rate {args.open_rate:g}: give a positive rate in req/s")

    with tempfile.TemporaryDirectory(prefix="trims-bench-gw-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)  # a root gateway runs function code as nobody: code dirs live here
        where = machine()
        bare = start([sys.executable, __file__, "--serve-bare"], root / "bare.log", r"port=(\d+)")
        gateway, url = start_gateway(
            root, "--preload", "numpy", "--store-socket", str(root / "none")
        )
        web_root = root / "web"
        web_root.mkdir()
        web_gateway, web_url = start_gateway(
            web_root, "--preload", "numpy", "--store-socket", str(root / "none"), "--no-fast-path"
        )
        proxy = None
        try:
            deploy_echo(url)
            deploy_echo(web_url)
            worker, worker_pid = echo_worker(gateway.proc.pid)
            proxy = start(
                [sys.executable, __file__, "--serve-proxy", worker],
                root / "proxy.log", r"port=(\d+)",
            )  # fmt: skip
            urls = {
                "bare": f"http://127.0.0.1:{bare.match.group(1)}/",
                "proxy": f"http://127.0.0.1:{proxy.match.group(1)}/",
                "echo": f"{url}/v1/functions/echo/invoke",
                "echo_web": f"{web_url}/v1/functions/echo/invoke",
            }
            # each server's CPU: its process tree; the proxy's and the worker's it uses
            pids = {
                "bare": [bare.proc.pid],
                "proxy": [proxy.proc.pid, worker_pid],
                "echo": [gateway.proc.pid],
                "echo_web": [web_gateway.proc.pid],
            }
            # alternate, so all see the same background load
            runs = [run_pair(urls, pids, args) for _ in range(args.repeat)]
        finally:
            if proxy is not None:
                proxy.stop()
            gateway.stop()
            web_gateway.stop()
            bare.stop()

    doc = summarize_runs(runs, args)
    doc["machine"] = where
    write_json(args.json, doc)
    text = table(doc)
    if "ratio" in doc:
        ratios = ", ".join(f"{r:.2f}" for r in doc["ratios"])
        text += f"\n\necho / bare = {doc['ratio']:.2f} (runs: {ratios}; {where})"
        floor = ", ".join(f"{r:.2f}" for r in doc["proxy_ratios"])
        text += f"\nminimal proxy / bare = {doc['proxy_ratio']:.2f} (runs: {floor})"
        web = ", ".join(f"{r:.2f}" for r in doc["web_ratios"])
        text += f"\necho --no-fast-path / bare = {doc['web_ratio']:.2f} (runs: {web})"
    for server in SERVERS:
        lag = doc.get(f"{server}_open_send_lag_p99_ms")
        if lag is not None and lag > LATE_MS:
            text += (
                f"\n\n{server}, open loop: the load generator sent its requests up to {lag:.1f} ms "
                "late (p99), so it, not only the server, limits that row; its latencies count the "
                "wait (lower --open-fraction to see the server alone)"
            )
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
