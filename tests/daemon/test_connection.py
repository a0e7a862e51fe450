"""The daemon's request handling in-process (daemon/connection.py): a failure no code expected
is still answered, and the connection keeps serving."""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.rawclient import RawClient
from trims.daemon import connection
from trims.daemon.metrics import DaemonMetrics
from trims.daemon.server import Server
from trims.daemon.settings import DaemonSettings
from trims.daemon.store import Store
from trims.errors import TrimsError


def _in_process(tmp_path: Path, calls: list[tuple[str, dict[str, Any]]]) -> list[object]:
    """Serve a store in this process and send ``calls`` on one connection from a thread; each
    call's result or the error it raised."""
    settings = DaemonSettings(store_dir=tmp_path / "store", socket_path=tmp_path / "store.sock")

    def client() -> list[object]:
        out: list[object] = []
        with RawClient(settings.socket_path, timeout=30.0) as raw:
            for op, args in calls:
                try:
                    out.append(raw.result(op, **args))
                except TrimsError as e:
                    out.append(e)
        return out

    async def main() -> list[object]:
        metrics = DaemonMetrics()
        store = Store(settings, metrics, policies={}, gpu=None)
        server = Server(settings, store, metrics)
        try:
            store.start()
            await server.start()
            return await asyncio.to_thread(client)
        finally:
            await server.close()
            store.close()

    return asyncio.run(main())


def test_a_cancelled_error_from_a_worker_thread_is_answered_as_an_internal_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = connection.dispatch

    async def dispatch(store: Store, caller: Any, op: str, *rest: Any) -> Any:
        if op == "list":

            def fails() -> None:  # asyncio turns this into its own CancelledError
                raise concurrent.futures.CancelledError()

            await asyncio.to_thread(fails)
        return await real(store, caller, op, *rest)

    monkeypatch.setattr(connection, "dispatch", dispatch)
    failed, stats = _in_process(tmp_path, [("list", {}), ("stats", {})])
    assert isinstance(failed, TrimsError) and "internal error in 'list'" in failed.message
    assert isinstance(stats, dict) and "tiers" in stats  # the same connection goes on
