"""The node-wide instance budget: idle instances of other functions make room, busy ones wait."""

from __future__ import annotations

import asyncio

from tests.fixtures.gateway import echo_spec, pid_alive


async def test_at_the_limit_the_least_recently_used_idle_instance_makes_room(start_gateway):
    gw = await start_gateway(max_instances_total=2)
    for name in ("one", "two", "three"):
        await gw.deploy(echo_spec(name))
    pids = {}
    for name in ("one", "two"):
        status, _, body = await gw.invoke(name, b"pid")
        assert status == 200
        pids[name] = int(body)
    status, _, body = await gw.invoke("three", b"pid")
    assert status == 200
    assert not pid_alive(pids["one"]), "the least recently used idle instance is stopped"
    assert pid_alive(pids["two"])
    assert gw.gateway.budget.total() <= 2

    # both instances busy: the request waits for one to finish, then takes its place
    busy = [asyncio.create_task(gw.invoke(n, b"sleep:1")) for n in ("two", "three")]
    await asyncio.sleep(0.2)
    status, _, body = await gw.invoke("one", b"back")
    assert (status, body) == (200, b"back")
    assert [(await t)[0] for t in busy] == [200, 200]
    assert gw.gateway.budget.total() <= 2
