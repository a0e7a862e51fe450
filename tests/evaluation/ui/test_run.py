"""Logging in, CSRF, and starting evaluations and traces from the page through a real gateway
whose evaluate and trace functions (stand-ins in funcs/uifuncs.py) run in real workers."""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from tests.evaluation.ui.seed import Seeded
from tests.fixtures.gateway import local_factory
from tests.fixtures.ui import (
    ADMIN,
    READER,
    RUNNER,
    UIClient,
    csrf_of,
    deploy,
    page,
)
from tests.fixtures.unprivileged import writable_by_functions
from trims.evaluation.db import ResultsDB
from trims.runtime import gateway_cli
from trims.runtime.gateway.app import create_app
from trims.runtime.settings import GatewaySettings

Start = Callable[..., Awaitable[UIClient]]
TOKENS = (ADMIN, READER, RUNNER)
EVALUATE_FORM = {
    "model": "digits-mlp",
    "scenario": "offline",
    "mode": "performance",
    "batch": "4",
    "min_duration_ms": "100",
    "min_query_count": "8",
}


Gate = tuple[str, Callable[[], Awaitable[None]]]


@pytest_asyncio.fixture
async def gate(tmp_path: Path) -> AsyncIterator[Gate]:
    """A Unix socket a stand-in function connects to and then waits on, and the call that
    waits for that connection (the function is running) and lets the function go."""
    path = writable_by_functions(tmp_path / "gate") / "gate.sock"
    connected: asyncio.Queue[asyncio.StreamWriter] = asyncio.Queue()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await connected.put(writer)

    server = await asyncio.start_unix_server(on_connect, path)
    path.chmod(0o777)  # the function may run as an unprivileged user

    async def release() -> None:
        writer = await asyncio.wait_for(connected.get(), 120)
        writer.write(b"go")
        await writer.drain()
        writer.close()

    yield str(path), release
    server.close()
    await server.wait_closed()


async def login(client: UIClient, token: str) -> None:
    data = {"token": token, "csrf": await csrf_of(client), "next": "/ui/evaluations"}
    async with client.post("/ui/login", data=data, allow_redirects=False) as r:
        assert r.status == 303, await r.text()
        assert r.headers["Location"] == "/ui/evaluations"


async def post(client: UIClient, path: str, form: dict[str, str]) -> tuple[int, str, str]:
    data = {**form, "csrf": await csrf_of(client)}
    async with client.post(path, data=data, allow_redirects=False) as r:
        return r.status, r.headers.get("Location", ""), await r.text()


async def landing(client: UIClient, run_page: str, timeout_s: float = 120.0) -> str:
    """Wait until the progress page sends the browser on; the page it names."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        async with client.get(run_page, allow_redirects=False) as r:
            if r.status == 303:
                return r.headers["Location"]
            text = await r.text()
            assert r.status == 200, text
            if "running" not in text.split("<h1>", 1)[1].split("</h1>", 1)[0]:
                return run_page
        await asyncio.sleep(0.05)
    raise AssertionError(f"{run_page} still running after {timeout_s}s")


async def test_read_pages_need_a_token_and_login_sets_a_strict_httponly_session_cookie(
    ui_gateway: Start,
) -> None:
    client = await ui_gateway(tokens=TOKENS)
    async with client.get("/ui/evaluations") as r:
        html = await r.text()
        assert r.status == 401
        cookie = r.headers["Set-Cookie"]
    assert "Log in with a token" in html
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/ui/" in cookie
    before = client.session.cookie_jar.filter_cookies(client.make_url("/ui/"))["trims_ui_session"]
    data = {"token": "not-a-known-token", "csrf": await csrf_of(client)}
    async with client.post("/ui/login", data=data) as r:
        assert r.status == 401 and "not known" in await r.text()
    await login(client, READER.secret)
    after = client.session.cookie_jar.filter_cookies(client.make_url("/ui/"))["trims_ui_session"]
    assert after.value != before.value  # a new session id on login
    html = await page(client, "/ui/evaluations")
    assert "Log out" in html and READER.secret not in html
    status, location, _ = await post(client, "/ui/logout", {})
    assert (status, location) == (303, "/ui/")
    await page(client, "/ui/evaluations", status=401)


async def test_post_forms_refuse_a_missing_or_foreign_csrf_token(
    ui_gateway: Start, seeded: Seeded
) -> None:
    client = await ui_gateway(tokens=TOKENS)
    await deploy(client, "evaluate", "evaluate", db=str(seeded.path))
    async with client.post("/ui/login", data={"token": RUNNER.secret}) as r:
        assert r.status == 403 and "CSRF" in await r.text()
    await login(client, RUNNER.secret)
    # another browser: its own session, so its own CSRF token
    jar = aiohttp.CookieJar(unsafe=True)
    async with (
        aiohttp.ClientSession(cookie_jar=jar) as other,
        other.get(client.make_url("/ui/login")) as r,
    ):
        m = re.search(r'name="csrf" value="([^"]+)"', await r.text())
    assert m is not None
    foreign = m.group(1)
    for csrf in (None, foreign):
        data = EVALUATE_FORM if csrf is None else {**EVALUATE_FORM, "csrf": csrf}
        async with client.post("/ui/run/evaluate", data=data, allow_redirects=False) as r:
            assert r.status == 403 and "reload the page" in await r.text()
    db = ResultsDB(str(seeded.path), readonly=True)
    try:
        assert len(db.evaluations()) == 3  # nothing ran
    finally:
        db.close()


async def test_starting_work_needs_the_functions_invoke_scope(
    ui_gateway: Start, seeded: Seeded
) -> None:
    client = await ui_gateway(tokens=TOKENS)
    await deploy(client, "evaluate", "evaluate", db=str(seeded.path))
    await login(client, READER.secret)
    status, _, html = await post(client, "/ui/run/evaluate", EVALUATE_FORM)
    assert status == 403 and "invoke:evaluate" in html
    status, _, html = await post(client, "/ui/run/evaluate", {**EVALUATE_FORM, "batch": "x"})
    assert status == 422 and "whole number" in html


async def test_an_evaluation_started_from_the_page_shows_progress_and_lands_on_its_result(
    ui_gateway: Start, seeded: Seeded, gate: Gate
) -> None:
    client = await ui_gateway(tokens=TOKENS)
    fifo, release = gate
    await deploy(client, "evaluate", "evaluate", db=str(seeded.path), gate=fifo)
    await login(client, RUNNER.secret)
    status, location, html = await post(client, "/ui/run/evaluate", EVALUATE_FORM)
    assert status == 303, html
    assert location.startswith("/ui/runs/")
    running = await page(client, location)
    assert "evaluate: running" in running and 'http-equiv="refresh"' in running
    assert "<progress" in running
    await release()
    result = await landing(client, location)
    assert result.startswith("/ui/evaluations/")
    html = await page(client, result)
    assert "Evaluation 4: digits-mlp (offline)" in html and "123.00 QPS" in html


async def test_a_trace_started_from_the_page_lands_on_its_timeline(
    ui_gateway: Start, seeded: Seeded
) -> None:
    client = await ui_gateway(tokens=TOKENS)
    await deploy(client, "trace", "trace", db=str(seeded.path))
    await login(client, RUNNER.secret)
    form = {"trace_model": "torch:resnet18", "framework": "torch", "level": "layer"}
    status, location, html = await post(client, "/ui/run/trace", form)
    assert status == 303, html
    result = await landing(client, location)
    assert result.startswith("/ui/traces/")
    assert 'class="span-name">model torch:resnet18</text>' in await page(client, result)


async def test_a_result_kept_in_another_database_is_explained(
    ui_gateway: Start, seeded: Seeded
) -> None:
    client = await ui_gateway()
    await deploy(client, "evaluate", "evaluate", db=str(seeded.path), record=False)
    status, location, html = await post(client, "/ui/run/evaluate", EVALUATE_FORM)
    assert status == 303, html
    assert await landing(client, location) == location
    html = await page(client, location)
    assert "does not hold the result" in html and "--results-db" in html


async def test_an_undeployed_function_is_named_with_how_to_deploy_it(ui_gateway: Start) -> None:
    client = await ui_gateway()
    status, _, html = await post(client, "/ui/run/trace", {"trace_model": "torch:resnet18"})
    assert status == 404 and "examples/trace/function.yaml" in html


async def test_without_the_evaluation_extra_the_ui_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "trims.evaluation.ui", None)  # import fails
    settings = GatewaySettings(port=0, auth=False, warm_executor=False)
    client: UIClient = TestClient(TestServer(create_app(settings, local_factory(tmp_path, None))))
    await client.start_server()
    try:
        async with client.get("/ui/") as r:
            assert r.status == 404
            assert "trims[evaluation]" in await r.text()
        async with client.get("/healthz") as r:
            assert r.status == 200
    finally:
        await client.close()


def test_the_gateway_flag_names_the_database_and_defaults_to_the_evaluate_one() -> None:
    parser = argparse.ArgumentParser()
    gateway_cli.configure(parser)
    args = parser.parse_args(["--results-db", "/data/r.sqlite"])
    assert gateway_cli.settings_from_args(args, {}).results_db == "/data/r.sqlite"
    args = parser.parse_args([])
    env = {"TRIMS_RESULTS_DB": "postgresql+psycopg://u@h/db"}
    assert gateway_cli.settings_from_args(args, env).results_db == env["TRIMS_RESULTS_DB"]
    env = {"XDG_DATA_HOME": "/data"}
    assert gateway_cli.settings_from_args(args, env).results_db == "/data/trims/results.sqlite"


async def test_a_failing_run_shows_the_functions_error(ui_gateway: Start) -> None:
    client = await ui_gateway()
    await deploy(client, "evaluate", "evaluate")  # no config.db: the handler fails
    status, location, html = await post(client, "/ui/run/evaluate", EVALUATE_FORM)
    assert status == 303, html
    assert await landing(client, location) == location
    html = await page(client, location)
    assert "The function answered 5" in html or "The run failed" in html
    assert "&#39;db&#39;" in html  # the KeyError the handler raised names the missing key
