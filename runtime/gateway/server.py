"""Running the gateway as a process: bind, wait for SIGTERM/SIGINT, drain, exit.

The signal handler only sets an event; the drain runs in the main task: readiness turns 503,
new requests are refused with 503, in-flight and queued requests finish (up to the drain
timeout), instances stop, then the listening socket closes.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Callable

from aiohttp import web

from trims.runtime.gateway.app import create_app
from trims.runtime.gateway.connections import ConnectionGuard, GuardedTCPSite
from trims.runtime.gateway.context import GATEWAY
from trims.runtime.gateway.fastpath import fast_invoke_for
from trims.runtime.gateway.service import ExecutorFactory
from trims.runtime.settings import GatewaySettings

log = logging.getLogger(__name__)


async def serve(
    settings: GatewaySettings,
    executor_factory: ExecutorFactory,
    *,
    on_ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (or ``stop`` is set), then drain and return."""
    app = create_app(settings, executor_factory)
    runner = await start_runner(app, settings)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await start_site(runner, settings, settings.host, settings.port)
        address = _address(runner)
        log.info("gateway listening on %s (executor %s)", address, settings.executor)
        freeze_startup_objects()
        if on_ready is not None:
            on_ready(address)
        await stop.wait()
        log.info(
            "gateway draining: finishing in-flight requests (up to %.0fs)", settings.drain_timeout_s
        )
        await app[GATEWAY].close(settings.drain_timeout_s)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
    log.info("gateway stopped")


def freeze_startup_objects() -> None:
    """Move every object alive now (imports, app, routes, metrics, restored functions) out of
    the collector's reach (``gc.freeze``).

    Note [gc tail]: they live as long as the process, yet every collection of an older
    generation walked them again, a pause on whichever request was running (1.4-1.6 ms in a
    gateway serving echo, once per 10,000 requests; see "Gateway hot path" in
    docs/runtime.md). Frozen, a collection walks only what requests made since; objects made
    later are collected as usual.
    """
    gc.collect()
    gc.freeze()


async def start_runner(app: web.Application, settings: GatewaySettings) -> web.AppRunner:
    """The app's runner, set up, with the settings' keep-alive timeout and access log."""
    runner = web.AppRunner(
        app,
        handle_signals=False,
        access_log=logging.getLogger("trims.access") if settings.access_log else None,
        keepalive_timeout=settings.keepalive_timeout_s,
    )
    await runner.setup()
    return runner


async def start_site(
    runner: web.AppRunner, settings: GatewaySettings, host: str, port: int
) -> GuardedTCPSite:
    """Listen on ``host:port`` behind the settings' connection limits (see connections.py),
    with the invoke fast path unless the settings or the app rule it out (fastpath.py)."""
    guard = ConnectionGuard(settings, fast_invoke_for(runner.app, settings))
    site = GuardedTCPSite(runner, guard, host=host, port=port, backlog=1024)
    await site.start()
    return site


def _address(runner: web.AppRunner) -> str:
    for addr in runner.addresses:
        if isinstance(addr, tuple):
            host, port = addr[0], addr[1]
            return f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
    raise RuntimeError("the gateway has no TCP address")
