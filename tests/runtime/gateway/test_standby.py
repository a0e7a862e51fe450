"""A function deployed with ``scaling.standby`` on a real gateway and local executor (Note
[standby instances] in runtime/gateway/pool.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import jsonschema

from tests.fixtures.gateway import echo_spec
from trims.runtime.gateway.pool import Pool


async def _standby_prepared(pool: Pool, limit_s: float = 30.0) -> None:
    """Wait until the pool holds a prepared standby (a refill comes on a reaper tick at least
    a second after an activation, so there is no single task to await from here)."""
    deadline = time.monotonic() + limit_s
    while not any(s.state == "standby" and s.prepared for s in pool.slots):
        assert time.monotonic() < deadline, "no standby was prepared"
        await asyncio.sleep(0.02)


def _states(doc: dict[str, Any]) -> dict[str, str]:
    return {i["id"]: i["state"] for i in doc["status"]["instances"]}


async def test_a_standby_serves_the_first_request_and_is_replaced(start_gateway: Any) -> None:
    gw = await start_gateway()
    await gw.deploy(echo_spec("warmish", standby=1))
    pool = gw.gateway.pools["warmish"]
    await _standby_prepared(pool)
    status, doc = await gw.get_json("/v1/functions/warmish")
    assert status == 200
    (standby_id,) = _states(doc)
    assert _states(doc) == {standby_id: "standby"}
    assert doc["status"]["instances"][0]["prepared"] is True
    status, api = await gw.get_json("/openapi.json")
    assert status == 200
    jsonschema.validate(doc["status"]["instances"][0], api["components"]["schemas"]["Instance"])
    async with gw.session.get(f"{gw.url}/metrics") as r:
        assert 'trims_instances{function="warmish",state="standby"} 1.0' in await r.text()

    status, _, body = await gw.invoke("warmish", b"pid")
    assert status == 200 and int(body) > 0
    status, doc = await gw.get_json("/v1/functions/warmish")
    assert _states(doc)[standby_id] == "ready", "the request activated the standby"
    await _standby_prepared(pool)
    status, doc = await gw.get_json("/v1/functions/warmish")
    assert sorted(_states(doc).values()) == ["ready", "standby"]


async def test_standby_on_an_executor_without_it_is_refused_at_deploy(start_gateway: Any) -> None:
    gw = await start_gateway()
    spec = {**echo_spec("boxed", standby=1), "executor": "kubernetes"}
    async with gw.session.put(f"{gw.url}/v1/functions/boxed", json=spec, headers=gw.headers()) as r:
        assert r.status == 422
        error = await r.json()
    assert "scaling.standby" in error["error"]["message"]
    assert "local and docker executors" in error["error"]["message"]
