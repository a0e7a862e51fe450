"""UI fixtures: a seeded results database and a real gateway (real local executor, real
worker processes) with the UI mounted, driven through aiohttp's test client.

``ui_gateway(**settings)`` starts one (authentication off unless the test gives tokens; the
results database is the seeded one unless ``results_db`` is given) and stops it at teardown.
``deploy(client, name, handler, **config)`` deploys a function of ``funcs/uifuncs.py``.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from tests.evaluation.ui.seed import Seeded, seed
from tests.fixtures.unprivileged import writable_by_functions
from tests.runtime.gateway.conftest import local_factory
from trims.runtime.gateway.app import create_app
from trims.runtime.settings import GatewaySettings, Token

FUNCS = Path(__file__).parent / "funcs"
ADMIN = Token("admin-secret-1", frozenset({"admin"}), "admin")
READER = Token("reader-secret-1", frozenset({"read"}), "reader")
RUNNER = Token("runner-secret-1", frozenset({"read", "invoke:evaluate", "invoke:trace"}), "runner")

UIClient = TestClient  # type: ignore[type-arg]


@pytest.fixture
def seeded(tmp_path: Path) -> Seeded:
    """The seeded database, in a folder the stand-in functions (run as an unprivileged user
    when the tests run as root) may write to."""
    seeded = seed(writable_by_functions(tmp_path / "results") / "results.sqlite")
    seeded.path.chmod(0o666)
    return seeded


@pytest_asyncio.fixture
async def ui_gateway(
    tmp_path: Path, seeded: Seeded
) -> AsyncIterator[Callable[..., Awaitable[UIClient]]]:
    clients: list[UIClient] = []

    async def start(**options: Any) -> UIClient:
        root = tmp_path / f"gateway{len(clients)}"
        root.mkdir()
        if "tokens" not in options:
            options.setdefault("auth", False)
        options.setdefault("results_db", str(seeded.path))
        settings = GatewaySettings(
            port=0, store_socket=root / "no-store.sock", drain_timeout_s=5.0, **options
        )
        app = create_app(settings, local_factory(root, settings.store_socket))
        client: UIClient = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()


async def deploy(client: UIClient, name: str, handler: str, **config: Any) -> None:
    spec = {
        "name": name,
        "handler": f"uifuncs:{handler}",
        "code_dir": str(FUNCS),
        "config": config,
        "scaling": {"max_instances": 1, "request_timeout_s": 60},
    }
    headers = {"Authorization": f"Bearer {ADMIN.secret}"}
    async with client.put(f"/v1/functions/{name}", json=spec, headers=headers) as r:
        assert r.status in (200, 201), await r.text()


async def page(client: UIClient, path: str, status: int = 200) -> str:
    """The HTML of ``path``, checking its status."""
    async with client.get(path, allow_redirects=False) as r:
        text = await r.text()
        assert r.status == status, text
        assert r.content_type == "text/html"
        return text


async def csrf_of(client: UIClient, path: str = "/ui/login") -> str:
    """The CSRF token of this client's session (from a form on ``path``)."""
    m = re.search(r'name="csrf" value="([^"]+)"', await page(client, path))
    assert m, f"no CSRF field on {path}"
    return m.group(1)
