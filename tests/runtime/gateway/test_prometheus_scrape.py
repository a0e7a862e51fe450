"""A real Prometheus server scrapes the gateway's and the daemon's /metrics endpoints.

Checks what an operator's Prometheus (and the Grafana dashboard on top of it) sees: both
targets up, the invocation counter of a function that was called, and the daemon's tier budget.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.fixtures.gateway import echo_spec
from tests.fixtures.net import free_port
from tests.fixtures.store import DaemonProcess

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="the prometheus binary is not installed (apt-get install prometheus)"
)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[list[str]], str]]:
    """Factory: ``prometheus(["127.0.0.1:PORT", ...])`` -> the base URL of a running server."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(targets: list[str]) -> str:
        assert PROMETHEUS is not None
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: trims\n"
            f"    static_configs: [{{targets: {targets!r}}}]\n"
        )
        port = free_port()
        log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(
            subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        )
        log.close()
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _query(session: aiohttp.ClientSession, base: str, promql: str) -> list[dict[str, Any]]:
    async with session.get(f"{base}/api/v1/query", params={"query": promql}) as r:
        doc = await r.json()
    assert doc["status"] == "success", doc
    result: list[dict[str, Any]] = doc["data"]["result"]
    return result


async def _wait_for(
    session: aiohttp.ClientSession, base: str, promql: str, timeout_s: float = 60.0
) -> list[dict[str, Any]]:
    """Poll until the query returns a non-empty result (Prometheus scrapes every second)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            result = await _query(session, base, promql)
            if result:
                return result
        except aiohttp.ClientConnectionError:
            pass  # Prometheus is still starting
        if loop.time() > deadline:
            raise AssertionError(f"Prometheus never answered {promql!r} with a sample")
        await asyncio.sleep(0.5)


async def test_prometheus_scrapes_gateway_and_daemon(
    start_gateway: Any,
    start_daemon: Callable[..., DaemonProcess],
    prometheus: Callable[[list[str]], str],
) -> None:
    daemon = start_daemon(metrics_address="127.0.0.1:0", cpu_budget="64MiB")
    assert daemon.metrics_url is not None
    gw = await start_gateway(store_socket=daemon.socket)
    await gw.deploy(echo_spec("scraped"))
    for _ in range(3):
        status, _, body = await gw.invoke("scraped", b"hello")
        assert status == 200, body

    gateway_target = gw.url.removeprefix("http://")
    daemon_target = daemon.metrics_url.removeprefix("http://").split("/", 1)[0]
    base = prometheus([gateway_target, daemon_target])
    async with aiohttp.ClientSession() as session:
        up = await _wait_for(session, base, "sum(up) == 2")
        assert float(up[0]["value"][1]) == 2.0
        calls = await _wait_for(session, base, 'sum(trims_invocations_total{function="scraped"})')
        assert float(calls[0]["value"][1]) == 3.0
        budget = await _wait_for(session, base, 'trims_tier_bytes_budget{tier="cpu"}')
        assert float(budget[0]["value"][1]) == 64 * 2**20
