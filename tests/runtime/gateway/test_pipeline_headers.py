"""Content types carried through pipelines and asynchronous results whatever the case of the
header names (workers label replies ``content-type``, handlers may write ``Content-Type``):
JSON stays JSON in chains, joins and async results; binary bodies are never mangled."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

from tests.fixtures.gateway import RunningGateway, echo_spec

BINARY = bytes(range(256))
#: echo's answer carries the request's content type; "headers" (a dict) is labelled
#: application/json by the worker, in lower case.
JOIN = {
    "name": "join",
    "steps": [
        {"name": "a", "function": "echo"},
        {"name": "b", "function": "echo"},
        {"name": "both", "function": "echo", "after": ["a", "b"]},
    ],
}
SINKS = {
    "name": "sinks",
    "steps": [{"name": "a", "function": "echo"}, {"name": "b", "function": "echo"}],
}
CHAIN = {
    "name": "chain",
    "steps": [
        {"name": "a", "function": "echo"},
        {"name": "b", "function": "echo", "after": ["a"]},
    ],
}


async def _ready(gw: RunningGateway) -> None:
    await gw.deploy(echo_spec("echo"))
    for spec in (JOIN, SINKS, CHAIN):
        async with gw.session.put(f"{gw.url}/v1/pipelines/{spec['name']}", json=spec) as r:
            assert r.status == 201, await r.text()


async def _invoke(
    gw: RunningGateway, path: str, body: bytes, content_type: str
) -> tuple[int, str, bytes]:
    async with gw.session.post(
        gw.url + path, data=body, headers={"content-type": content_type}
    ) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.read()


async def _finished(gw: RunningGateway, path: str, body: bytes, content_type: str) -> Any:
    status, _, accepted = await _invoke(gw, path, body, content_type)
    assert status == 202, accepted
    location = json.loads(accepted)["status_url"]
    for _ in range(600):
        status, record = await gw.get_json(location)
        assert status == 200
        if record["state"] != "running":
            return record
        await asyncio.sleep(0.05)
    raise AssertionError(f"{location} still running")


async def test_joins_embed_json_answers_as_json(start_gateway: Any) -> None:
    gw = await start_gateway()
    await _ready(gw)
    doc = {"texts": ["a", "b"], "n": 2}
    for name in ("join", "sinks"):
        status, content_type, body = await _invoke(
            gw, f"/v1/pipelines/{name}/invoke", json.dumps(doc).encode(), "application/json"
        )
        assert status == 200 and content_type.startswith("application/json")
        assert json.loads(body) == {"a": doc, "b": doc}, name


async def test_joins_keep_binary_answers_whole(start_gateway: Any) -> None:
    gw = await start_gateway()
    await _ready(gw)
    status, _, body = await _invoke(gw, "/v1/pipelines/join/invoke", BINARY, "image/png")
    assert status == 200
    joined = json.loads(body)
    for step in ("a", "b"):
        entry = joined[step]
        assert entry["content_type"] == "image/png" and entry["encoding"] == "base64"
        assert base64.b64decode(entry["body"]) == BINARY


async def test_a_chain_answers_with_the_content_type_it_was_given(start_gateway: Any) -> None:
    gw = await start_gateway()
    await _ready(gw)
    doc = b'{"x": [1, 2]}'
    assert await _invoke(gw, "/v1/pipelines/chain/invoke", doc, "application/json") == (
        200,
        "application/json",
        doc,
    )
    assert await _invoke(gw, "/v1/pipelines/chain/invoke", BINARY, "image/png") == (
        200,
        "image/png",
        BINARY,
    )


async def test_async_results_report_the_answer_content_type(start_gateway: Any) -> None:
    gw = await start_gateway()
    await _ready(gw)
    doc = b'{"x": 1}'
    record = await _finished(gw, "/v1/pipelines/chain/invoke?async=true", doc, "application/json")
    assert record["result"]["content_type"] == "application/json"
    assert json.loads(record["result"]["body"]) == {"x": 1}
    record = await _finished(gw, "/v1/pipelines/join/invoke?async=true", doc, "application/json")
    assert record["result"]["content_type"] == "application/json"
    assert json.loads(record["result"]["body"]) == {"a": {"x": 1}, "b": {"x": 1}}
    # A handler's dict answer is labelled by the worker in lower case ("content-type").
    record = await _finished(gw, "/v1/functions/echo/invoke?async=true", b"headers", "text/x")
    assert record["result"]["content_type"] == "application/json"
    assert json.loads(record["result"]["body"])["content-type"] == "text/x"
    record = await _finished(gw, "/v1/functions/echo/invoke?async=true", BINARY, "image/png")
    assert record["result"]["content_type"] == "image/png"
    assert record["result"]["encoding"] == "base64"
    assert base64.b64decode(record["result"]["body"]) == BINARY
