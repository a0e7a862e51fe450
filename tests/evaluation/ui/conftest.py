"""UI fixtures: a seeded results database and a real gateway (real local executor, real
worker processes) with the UI mounted, driven through aiohttp's test client.

``ui_gateway(**settings)`` starts one (authentication off unless the test gives tokens; the
results database is the seeded one unless ``results_db`` is given) and stops it at teardown.
``ui_alone(gateway, **ui_config)`` serves the UI alone, built with the UIConfig a test gives
(a small session store, few login tries), calling that gateway's API.
The helpers the tests share (``deploy``, ``page``, tokens) are in tests/fixtures/ui.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.evaluation.ui.seed import Seeded, seed
from tests.fixtures.gateway import local_factory
from tests.fixtures.ui import UIClient
from tests.fixtures.unprivileged import writable_by_functions
from trims.evaluation.ui import UIConfig, create_ui_app
from trims.runtime.gateway.app import create_app
from trims.runtime.settings import GatewaySettings


@pytest.fixture
def seeded(tmp_path: Path) -> Seeded:
    """The seeded database, in a folder the stand-in functions (run as an unprivileged user
    when the tests run as root) may write to."""
    seeded = seed(writable_by_functions(tmp_path / "results") / "results.sqlite")
    seeded.path.chmod(0o666)
    return seeded


class _Clients:
    """Test clients of the apps a fixture serves, closed together at its end."""

    def __init__(self) -> None:
        self.served: list[UIClient] = []

    async def serve(self, app: web.Application) -> UIClient:
        client: UIClient = TestClient(TestServer(app))
        await client.start_server()
        self.served.append(client)
        return client

    async def close(self) -> None:
        for client in self.served:
            await client.close()


@pytest_asyncio.fixture
async def ui_gateway(
    tmp_path: Path, seeded: Seeded
) -> AsyncIterator[Callable[..., Awaitable[UIClient]]]:
    clients = _Clients()

    async def start(**options: Any) -> UIClient:
        root = tmp_path / f"gateway{len(clients.served)}"
        root.mkdir()
        if "tokens" not in options:
            options.setdefault("auth", False)
        options.setdefault("results_db", str(seeded.path))
        settings = GatewaySettings(
            port=0, store_socket=root / "no-store.sock", drain_timeout_s=5.0, **options
        )
        return await clients.serve(create_app(settings, local_factory(root, settings.store_socket)))

    yield start
    await clients.close()


@pytest_asyncio.fixture
async def ui_alone(seeded: Seeded) -> AsyncIterator[Callable[..., Awaitable[UIClient]]]:
    clients = _Clients()

    async def start(gateway: UIClient, **options: Any) -> UIClient:
        options.setdefault("results_db", str(seeded.path))
        config = UIConfig(api_url=str(gateway.make_url("/")).rstrip("/"), **options)
        app = web.Application()
        app.add_subapp("/ui", create_ui_app(config))
        return await clients.serve(app)

    yield start
    await clients.close()
