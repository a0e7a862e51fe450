"""The web UI under a hostile local user (issue 41, finding 9): a flood of cookieless requests
must not push out a logged-in session, one peer's token guessing is held back without holding
back another peer's login, and a malformed row in the results database leaves the list and
comparison pages readable, the row left out and named."""

from __future__ import annotations

import logging
import re
import sqlite3
import uuid
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from tests.evaluation.ui.seed import Seeded
from tests.fixtures.ui import ADMIN, READER, UIClient, csrf_of, page

Start = Callable[..., Awaitable[UIClient]]
StartAlone = Callable[..., Awaitable[UIClient]]
TOKENS = (ADMIN, READER)


async def _login(client: UIClient, token: str) -> int:
    data = {"token": token, "csrf": await csrf_of(client), "next": "/ui/evaluations"}
    async with client.post("/ui/login", data=data, allow_redirects=False) as r:
        return r.status


async def test_cookieless_requests_beyond_the_capacity_keep_a_logged_in_session(
    ui_gateway: Start, ui_alone: StartAlone
) -> None:
    gateway = await ui_gateway(tokens=TOKENS)
    ui = await ui_alone(gateway, max_sessions=50)
    assert await _login(ui, ADMIN.secret) == 303
    jarless = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())
    async with jarless:
        for _ in range(120):
            async with jarless.get(ui.make_url("/ui/login")) as r:
                assert r.status == 200 and "trims_ui_session" in r.headers["Set-Cookie"]
    html = await page(ui, "/ui/evaluations")
    assert "Log out" in html


async def test_a_peer_that_guesses_is_refused_while_another_peer_logs_in(
    ui_gateway: Start, ui_alone: StartAlone
) -> None:
    gateway = await ui_gateway(tokens=TOKENS)
    ui = await ui_alone(gateway, login_attempts=3, login_refill_s=3600.0)
    for _ in range(3):
        assert await _login(ui, "guess-" + uuid.uuid4().hex) == 401
    data = {"token": "guess-4", "csrf": await csrf_of(ui)}
    async with ui.post("/ui/login", data=data, allow_redirects=False) as r:
        assert r.status == 429, await r.text()
        assert int(r.headers["Retry-After"]) > 0
        assert "too many failed logins" in await r.text()
    # the right token from the guessing peer waits too: otherwise guessing goes on unlimited
    assert await _login(ui, ADMIN.secret) == 429
    # another peer (another loopback address) keeps its own tries
    connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
    async with aiohttp.ClientSession(
        connector=connector, cookie_jar=aiohttp.CookieJar(unsafe=True)
    ) as other:
        async with other.get(ui.make_url("/ui/login")) as r:
            m = re.search(r'name="csrf" value="([^"]+)"', await r.text())
        assert m is not None
        data = {"token": ADMIN.secret, "csrf": m.group(1), "next": "/ui/evaluations"}
        async with other.post(ui.make_url("/ui/login"), data=data, allow_redirects=False) as r:
            assert r.status == 303, await r.text()
        async with other.get(ui.make_url("/ui/evaluations")) as r:
            assert r.status == 200 and "Log out" in await r.text()


def _insert_malformed(seeded: Seeded) -> int:
    """A copy of the first seeded evaluation with a scenario no evaluation has, written with
    sqlite3 (as a user who can write the database could); its id."""
    with sqlite3.connect(seeded.path) as con:
        columns = [row[1] for row in con.execute("PRAGMA table_info(evaluations)")]
        first = con.execute("SELECT * FROM evaluations WHERE id = 1").fetchone()
        values = dict(zip(columns, first, strict=True))
        del values["id"]
        values.update(run_id=str(uuid.uuid4()), scenario="bogus")
        names = ", ".join(values)
        marks = ", ".join("?" * len(values))
        cursor = con.execute(
            f"INSERT INTO evaluations ({names}) VALUES ({marks})", list(values.values())
        )
        assert cursor.lastrowid is not None
        return cursor.lastrowid


async def test_a_malformed_row_is_left_out_and_flagged_not_an_error_for_everyone(
    ui_gateway: Start, seeded: Seeded, caplog: pytest.LogCaptureFixture
) -> None:
    bad = _insert_malformed(seeded)
    client = await ui_gateway()
    caplog.set_level(logging.WARNING, logger="trims.evaluation.ui.data")
    for _ in range(2):
        html = await page(client, "/ui/evaluations")
        assert f"1 row could not be read: id {bad}." in html
        assert "3 of 3 evaluations" in html
        for id_ in seeded.ids:
            assert f'href="/ui/evaluations/{id_}"' in html
        assert f'href="/ui/evaluations/{bad}"' not in html
    first, second = seeded.ids[:2]
    html = await page(client, f"/ui/compare?e={first}&e={bad}&e={second}")
    assert f"1 row could not be read: id {bad}." in html and "Comparison of 2 evaluations" in html
    html = await page(client, f"/ui/evaluations/{bad}", status=422)
    assert f"evaluation {bad} in" in html and "bogus" in html
    logged = [r for r in caplog.records if f"evaluation {bad} in" in r.getMessage()]
    assert len(logged) == 1, logged
