"""Model readiness and Triton's model repository extension (index, load, unload)."""

from __future__ import annotations

import asyncio

from tests.fixtures.gateway import ADMIN, doubler_spec, echo_spec
from trims.runtime.settings import Token

READER = Token("reader-secret-1", frozenset({"read"}), "reader")

ONE = {
    "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}],
    "outputs": [{"name": "y"}],
}


def failing_spec(name: str = "broken", **scaling: object) -> dict[str, object]:
    """A served model whose init always raises."""
    spec = echo_spec(name, "oipbroken:handler", **scaling)
    spec["serves"] = doubler_spec()["serves"]
    return spec


async def _call(gw, method: str, path: str, token: str | None = None, json: object = None):
    async with gw.session.request(method, gw.url + path, json=json, headers=gw.headers(token)) as r:
        return r.status, await r.json()


async def test_a_model_whose_init_fails_is_not_ready_nor_is_the_server(start_gateway):
    gw = await start_gateway()
    await gw.deploy(doubler_spec())
    await gw.deploy(failing_spec())
    assert (await _call(gw, "GET", "/v2/health/ready"))[0] == 200
    status, doc = await _call(gw, "POST", "/v2/models/broken/infer", json=ONE)
    assert status == 502 and "init refuses to start" in doc["error"], doc

    status, doc = await _call(gw, "GET", "/v2/models/broken/ready")
    assert status == 503 and doc["ready"] is False, doc
    assert "init refuses to start" in doc["reason"]
    assert (await _call(gw, "GET", "/v2/models/broken/versions/1/ready"))[0] == 503
    assert (await _call(gw, "GET", "/v2/models/doubler/ready")) == (
        200,
        {"name": "doubler", "ready": True},
    )
    assert await _call(gw, "GET", "/v2/health/ready") == (503, {"ready": False})

    status, index = await _call(gw, "POST", "/v2/repository/index")
    assert status == 200
    states = {entry["name"]: entry for entry in index}
    assert states["doubler"] == {"name": "doubler", "version": "1", "state": "READY", "reason": ""}
    assert states["broken"]["state"] == "UNAVAILABLE"
    assert "init refuses to start" in states["broken"]["reason"]
    status, index = await _call(gw, "POST", "/v2/repository/index", json={"ready": True})
    assert [e["name"] for e in index] == ["doubler"]

    status, doc = await _call(gw, "POST", "/v2/repository/models/broken/load")
    assert status == 502 and "init refuses to start" in doc["error"], doc
    # Removing the broken model makes the server ready again.
    async with gw.session.delete(f"{gw.url}/v1/functions/broken") as r:
        assert r.status == 200
    assert (await _call(gw, "GET", "/v2/health/ready"))[0] == 200


async def test_unload_scales_to_zero_and_load_brings_it_back(start_gateway):
    gw = await start_gateway(tokens=(ADMIN, READER))
    await gw.deploy(doubler_spec() | {"scaling": {"min_instances": 1}})
    status, doc = await _call(gw, "POST", "/v2/repository/models/doubler/load")
    assert status == 200, doc
    _, fn = await gw.get_json("/v1/functions/doubler")
    assert [i["state"] for i in fn["status"]["instances"]] == ["ready"]

    assert (await _call(gw, "POST", "/v2/repository/models/doubler/unload", READER.secret))[
        0
    ] == 403
    assert (await _call(gw, "POST", "/v2/repository/index", READER.secret))[0] == 200
    status, doc = await _call(gw, "POST", "/v2/repository/models/doubler/unload")
    assert status == 200, doc
    _, fn = await gw.get_json("/v1/functions/doubler")
    assert fn["spec"]["scaling"]["min_instances"] == 0
    assert fn["status"]["instances"] == []
    status, doc = await _call(gw, "GET", "/v2/models/doubler/ready")
    assert (status, doc["reason"]) == (503, "unloaded")
    status, doc = await _call(gw, "POST", "/v2/models/doubler/infer", json=ONE)
    assert status == 503 and "/v2/repository/models/doubler/load" in doc["error"], doc
    status, index = await _call(gw, "POST", "/v2/repository/index")
    assert index == [
        {"name": "doubler", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
    ]
    # An unloaded model does not make the server unready (Triton: only loaded models count).
    assert (await _call(gw, "GET", "/v2/health/ready"))[0] == 200

    assert (await _call(gw, "POST", "/v2/repository/models/doubler/load", READER.secret))[0] == 403
    status, doc = await _call(gw, "POST", "/v2/repository/models/doubler/load")
    assert status == 200, doc
    _, fn = await gw.get_json("/v1/functions/doubler")
    assert fn["spec"]["scaling"]["min_instances"] == 1
    assert "ready" in [i["state"] for i in fn["status"]["instances"]]
    assert (await _call(gw, "GET", "/v2/models/doubler/ready"))[0] == 200
    status, doc = await _call(gw, "POST", "/v2/models/doubler/infer", json=ONE)
    assert status == 200 and doc["outputs"][0]["data"] == [2.0], doc


async def test_repository_errors(start_gateway):
    gw = await start_gateway()
    status, doc = await _call(gw, "POST", "/v2/repository/models/nope/load")
    assert status == 404 and "PUT /v1/functions" in doc["error"], doc
    status, doc = await _call(gw, "POST", "/v2/repository/index", json={"ready": "yes"})
    assert status == 400 and "'ready'" in doc["error"]
    await gw.deploy(echo_spec())  # a function without serves is no model
    assert await _call(gw, "POST", "/v2/repository/index") == (200, [])
    status, _ = await _call(gw, "POST", "/v2/repository/models/echo/unload")
    assert status == 404


def _triton_repository(url: str, headers: dict[str, str]) -> None:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(url=url.removeprefix("http://"))
    try:
        assert client.is_model_ready("doubler", headers=headers)
        client.unload_model("doubler", headers=headers)
        assert not client.is_model_ready("doubler", headers=headers)
        index = client.get_model_repository_index(headers=headers)
        assert [(m["name"], m["state"]) for m in index] == [("doubler", "UNAVAILABLE")]
        try:
            client.load_model("nope", headers=headers)
        except InferenceServerException as e:
            assert "no model named 'nope'" in str(e)  # the message, not a dict's repr
        else:
            raise AssertionError("loading an unknown model succeeded")
        client.load_model("doubler", headers=headers)
        assert client.is_model_ready("doubler", headers=headers)
    finally:
        client.close()


async def test_tritonclient_drives_the_repository(start_gateway):
    gw = await start_gateway(tokens=(ADMIN,))
    await gw.deploy(doubler_spec())
    await asyncio.to_thread(_triton_repository, gw.url, gw.headers())


async def test_an_unloaded_model_keeps_no_standby_and_load_gives_it_back(start_gateway):
    gw = await start_gateway()
    await gw.deploy(doubler_spec() | {"scaling": {"standby": 1}})
    status, doc = await _call(gw, "POST", "/v2/repository/models/doubler/unload")
    assert status == 200, doc
    _, fn = await gw.get_json("/v1/functions/doubler")
    assert fn["spec"]["scaling"]["standby"] == 0
    assert fn["status"]["instances"] == [], "the unloaded deployment keeps no standby"
    status, doc = await _call(gw, "POST", "/v2/repository/models/doubler/load")
    assert status == 200, doc
    _, fn = await gw.get_json("/v1/functions/doubler")
    assert fn["spec"]["scaling"]["standby"] == 1
