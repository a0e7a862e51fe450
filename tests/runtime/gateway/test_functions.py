"""The functions API over a real gateway and real local workers."""

from __future__ import annotations

import asyncio

from tests.fixtures.gateway import ADMIN, echo_spec


async def test_deploy_invoke_list_get_delete(start_gateway):
    gw = await start_gateway(tokens=(ADMIN,))
    doc = await gw.deploy(echo_spec())
    assert doc["spec"]["handler"] == "gwfuncs:handler"
    assert doc["status"]["instances"] == []  # scale from zero: nothing runs before a request

    status, headers, body = await gw.invoke(
        "echo", b'{"a": 1}', {"Content-Type": "application/json"}
    )
    assert (status, body) == (200, b'{"a": 1}')
    assert headers["Content-Type"].startswith("application/json")

    status, listing = await gw.get_json("/v1/functions")
    assert [f["spec"]["name"] for f in listing["functions"]] == ["echo"]
    status, one = await gw.get_json("/v1/functions/echo")
    assert [i["state"] for i in one["status"]["instances"]] == ["ready"]

    async with gw.session.delete(f"{gw.url}/v1/functions/echo", headers=gw.headers()) as r:
        assert r.status == 200 and (await r.json()) == {"deleted": "echo"}
    status, err = await gw.get_json("/v1/functions/echo")
    assert status == 404 and err["error"]["code"] == "not_found"
    status, _, body = await gw.invoke("echo", b"x")
    assert status == 404


async def test_caller_credentials_are_not_passed_to_the_function(start_gateway):
    gw = await start_gateway(tokens=(ADMIN,))
    await gw.deploy(echo_spec())
    status, _, body = await gw.invoke("echo", b"headers", {"X-Custom": "yes"})
    assert status == 200
    seen = {k.lower(): v for k, v in __import__("json").loads(body).items()}
    assert seen["x-custom"] == "yes"
    assert "authorization" not in seen


async def test_invalid_specs_answer_json_errors_naming_the_field(start_gateway):
    gw = await start_gateway()
    cases = [
        ({"name": "Bad_Name", "handler": "m:f"}, 422, "name"),
        ({"name": "ok", "handler": "m:f", "scaling": {"concurrency": 0}}, 422, "concurrency"),
        ({"name": "ok", "handler": "m:f", "bogus": 1}, 422, "bogus"),
        ([1, 2], 422, "object"),
        ({"name": "ok", "handler": "m:f", "scaling": {"max_instances": 65}}, 422, "use at most 64"),
        ({"name": "ok", "handler": "m:f", "executor": "lambda"}, 422, "unknown executor 'lambda'"),
    ]
    for spec, want_status, word in cases:
        async with gw.session.post(f"{gw.url}/v1/functions", json=spec) as r:
            doc = await r.json()
            assert r.status == want_status, doc
            assert word in doc["error"]["message"]
    async with gw.session.post(f"{gw.url}/v1/functions", data=b"{not json") as r:
        assert r.status == 400 and "JSON" in (await r.json())["error"]["message"]
    await gw.deploy(echo_spec())
    async with gw.session.post(f"{gw.url}/v1/functions", json=echo_spec()) as r:
        assert r.status == 409
    async with gw.session.put(f"{gw.url}/v1/functions/other", json=echo_spec()) as r:
        assert r.status == 422 and "path" in (await r.json())["error"]["message"]


async def test_async_invocation_answers_202_then_the_result(start_gateway):
    gw = await start_gateway()
    await gw.deploy(echo_spec())
    async with gw.session.post(f"{gw.url}/v1/functions/echo/invoke?async=true", data=b"later") as r:
        assert r.status == 202
        accepted = await r.json()
        assert r.headers["Location"] == accepted["status_url"]
    for _ in range(400):
        status, record = await gw.get_json(accepted["status_url"])
        assert status == 200
        if record["state"] != "running":
            break
        await asyncio.sleep(0.05)
    assert record["state"] == "succeeded"
    assert record["result"] == {
        "status": 200,
        "content_type": "application/octet-stream",
        "body": "later",
        "encoding": "utf-8",
    }
    status, err = await gw.get_json("/v1/invocations/nope")
    assert status == 404 and "expired" in err["error"]["message"]


async def test_body_over_the_function_limit_is_413(start_gateway):
    gw = await start_gateway()
    await gw.deploy(echo_spec(max_body_bytes=1024))
    status, _, body = await gw.invoke("echo", b"x" * 1024)
    assert status == 200 and len(body) == 1024
    status, _, body = await gw.invoke("echo", b"x" * 1025)
    assert status == 413 and b"max_body_bytes" in body


async def test_scale_from_zero_then_to_zero_when_idle(start_gateway):
    gw = await start_gateway()
    await gw.deploy(echo_spec(idle_timeout_s=0.3))
    status, _, _ = await gw.invoke("echo", b"hi")
    assert status == 200
    pool = gw.gateway.pool("echo")
    assert pool.counts()["ready"] == 1
    for _ in range(200):
        if not pool.slots:
            break
        await asyncio.sleep(0.05)
    assert pool.slots == []
    status, _, body = await gw.invoke("echo", b"again")
    assert (status, body) == (200, b"again")


async def test_min_instances_start_without_a_request(start_gateway):
    gw = await start_gateway()
    await gw.deploy(echo_spec(min_instances=2, idle_timeout_s=0.2))
    pool = gw.gateway.pool("echo")
    for _ in range(400):
        if pool.counts()["ready"] == 2:
            break
        await asyncio.sleep(0.05)
    assert pool.counts()["ready"] == 2
    await asyncio.sleep(0.5)
    assert pool.counts()["ready"] == 2  # idle, but min_instances keeps them
