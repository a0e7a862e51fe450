"""The web UI under a hostile local user (issue 41, finding 9): a flood of cookieless requests
must not push out a logged-in session, one peer's token guessing is held back without holding
back another local user's login, and a malformed row in the results database leaves the list and
comparison pages readable, the row left out and named."""

from __future__ import annotations

import asyncio
import http.client
import logging
import os
import re
import sqlite3
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from tests.evaluation.ui.seed import Seeded
from tests.fixtures.ui import ADMIN, READER, UIClient, csrf_of, page
from tests.fixtures.users import NOBODY, run_as

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


def _guesses(url: str, tokens: list[str]) -> list[int]:
    """Log in with each of ``tokens`` from a fresh browser session, as a plain HTTP client:
    the statuses (run in a child that became another local user)."""
    parts = urllib.parse.urlsplit(url)
    statuses = []
    for token in tokens:
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
        conn.request("GET", "/ui/login")
        r = conn.getresponse()
        cookie = r.headers["Set-Cookie"].split(";", 1)[0]
        m = re.search(r'name="csrf" value="([^"]+)"', r.read().decode())
        assert m is not None
        body = urllib.parse.urlencode({"token": token, "csrf": m.group(1)})
        headers = {"Cookie": cookie, "Content-Type": "application/x-www-form-urlencoded"}
        conn.request("POST", "/ui/login", body=body, headers=headers)
        r = conn.getresponse()
        r.read()
        statuses.append(r.status)
        conn.close()
    return statuses


@pytest.mark.skipif(os.getuid() != 0, reason="plays another local user: needs root to setuid")
async def test_a_local_user_that_guesses_is_refused_while_another_user_logs_in(
    ui_gateway: Start, ui_alone: StartAlone
) -> None:
    # Every local user connects from 127.0.0.1: tries are counted per local user (the kernel
    # says whose the connection is), so one user's guessing never locks another out.
    gateway = await ui_gateway(tokens=TOKENS)
    ui = await ui_alone(gateway, login_attempts=3, login_refill_s=3600.0)
    url = str(ui.make_url("/"))
    guesses = ["guess-" + uuid.uuid4().hex for _ in range(4)]
    # the right token from the guessing user waits too: otherwise guessing goes on unlimited
    statuses = await asyncio.to_thread(
        run_as, NOBODY, lambda: _guesses(url, [*guesses, ADMIN.secret])
    )
    assert statuses == [401, 401, 401, 429, 429]
    # another local user (this one, root) on the same loopback address keeps its own tries
    assert await _login(ui, ADMIN.secret) == 303
    assert "Log out" in await page(ui, "/ui/evaluations")


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
