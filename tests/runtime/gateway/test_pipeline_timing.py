"""Pipelines timed per step: Server-Timing (sync and async), per-step outputs, content types
carried through steps, and the pipeline metrics, on a real gateway with real workers."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from typing import Any

from tests.fixtures.gateway import RunningGateway, echo_spec
from trims.evaluation.harness.pipeline_sut import parse_server_timing
from trims.runtime.gateway.invocations import Outcome
from trims.runtime.gateway.pipelines import ENVELOPE_TYPE, server_timing

#: Two echo steps: each answers its input body with its input content type.
TWO_STEPS = {
    "name": "twice",
    "steps": [
        {"name": "first", "function": "echo"},
        {"name": "second", "function": "echo", "after": ["first"]},
    ],
}
#: echo then upper: upper answers bytes, which the worker labels in lower case (content-type).
SHOUT = {
    "name": "shout",
    "steps": [
        {"name": "say", "function": "echo"},
        {"name": "loud", "function": "upper", "after": ["say"]},
        {"name": "again", "function": "echo", "after": ["loud"]},
    ],
}
BINARY = bytes(range(256)) * 3


async def _ready(gw: RunningGateway, *pipelines: dict[str, Any]) -> None:
    await gw.deploy(echo_spec("echo"))
    await gw.deploy(echo_spec("upper", handler="gwfuncs:upper"))
    for spec in pipelines:
        async with gw.session.put(f"{gw.url}/v1/pipelines/{spec['name']}", json=spec) as r:
            assert r.status == 201, await r.text()


async def _invoke(
    gw: RunningGateway, name: str, body: bytes, headers: dict[str, str], query: str = ""
) -> tuple[int, Any, bytes]:
    url = f"{gw.url}/v1/pipelines/{name}/invoke{query}"
    async with gw.session.post(url, data=body, headers=headers) as r:
        return r.status, r.headers.copy(), await r.read()


def _stages(header: str) -> list[str]:
    return [m.split(";")[0].strip() for m in header.split(",")]


async def test_server_timing_names_every_step_and_the_total(start_gateway):
    gw = await start_gateway()
    await _ready(gw, TWO_STEPS)
    status, headers, body = await _invoke(gw, "twice", b"hello", {"Content-Type": "text/plain"})
    assert status == 200 and body == b"hello"
    header = headers["Server-Timing"]
    assert _stages(header) == ["first", "second", "total"]
    assert re.fullmatch(r"(\w+;dur=\d+\.\d{3})(, \w+;dur=\d+\.\d{3})*", header), header
    ms = parse_server_timing(header)
    assert ms["total"] >= ms["first"] + ms["second"], "the steps run one after the other"


async def test_content_types_survive_two_steps_for_json_and_binary(start_gateway):
    gw = await start_gateway()
    await _ready(gw, TWO_STEPS, SHOUT)
    doc = json.dumps({"digits": [1, 2, 3]}).encode()
    status, headers, body = await _invoke(gw, "twice", doc, {"Content-Type": "application/json"})
    assert status == 200 and json.loads(body) == {"digits": [1, 2, 3]}
    assert headers["Content-Type"] == "application/json"
    status, headers, body = await _invoke(gw, "twice", BINARY, {"Content-Type": "image/png"})
    assert status == 200 and body == BINARY
    assert headers["Content-Type"] == "image/png"
    # A handler's dict reply is labelled "content-type" (lower case) by the worker: the next
    # step must still get application/json.
    status, headers, body = await _invoke(gw, "twice", b"headers", {})
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert json.loads(body)["content-type"] == "application/octet-stream"
    status, headers, body = await _invoke(gw, "shout", b"abc", {"Content-Type": "text/plain"})
    assert status == 200 and body == b"ABC"
    assert headers["Content-Type"] == "application/octet-stream"
    assert _stages(headers["Server-Timing"]) == ["say", "loud", "again", "total"]


async def test_per_step_outputs_on_request(start_gateway):
    gw = await start_gateway()
    await _ready(gw, SHOUT)
    for query, extra in (("?outputs=true", {}), ("", {"trims-pipeline-outputs": "true"})):
        headers = {"Content-Type": "text/plain", **extra}
        status, got, body = await _invoke(gw, "shout", b"abc", headers, query)
        assert status == 200
        assert got["Content-Type"] == ENVELOPE_TYPE
        assert _stages(got["Server-Timing"]) == ["say", "loud", "again", "total"]
        doc = json.loads(body)
        assert doc["pipeline"] == "shout" and doc["total_ms"] >= 0
        assert doc["output"]["body"] == "ABC"
        stages = {s["step"]: s for s in doc["stages"]}
        assert list(stages) == ["say", "loud", "again"]
        assert stages["say"]["content_type"].startswith("text/plain")
        assert stages["say"]["body"] == "abc" and stages["loud"]["body"] == "ABC"
        assert stages["loud"]["content_type"] == "application/octet-stream"
        assert stages["loud"]["function"] == "upper" and stages["loud"]["duration_ms"] >= 0
    status, _, body = await _invoke(gw, "shout", b"abc", {}, "?outputs=maybe")
    assert status == 422 and b"outputs: use true or false" in body


async def test_binary_step_outputs_are_base64_and_bounded(start_gateway):
    gw = await start_gateway(max_body_bytes=2 * len(BINARY) + 10)
    await _ready(gw, TWO_STEPS)
    headers = {"Content-Type": "image/png", "trims-pipeline-outputs": "true"}
    status, _, body = await _invoke(gw, "twice", BINARY, headers)
    assert status == 200
    doc = json.loads(body)
    assert doc["output"]["encoding"] == "base64"
    assert base64.b64decode(doc["output"]["body"]) == BINARY
    first, second = doc["stages"]
    assert first["content_type"] == "image/png" and base64.b64decode(first["body"]) == BINARY
    assert "body" not in second and "max_body_bytes" in second["omitted"]
    assert second["status"] == 200 and second["duration_ms"] >= 0


async def test_async_pipeline_result_carries_server_timing(start_gateway):
    gw = await start_gateway()
    await _ready(gw, SHOUT)
    status, headers, body = await _invoke(gw, "shout", b"later", {}, "?async=true")
    assert status == 202
    accepted = json.loads(body)
    assert headers["Location"] == accepted["status_url"] and accepted["pipeline"] == "shout"
    for _ in range(400):
        status, record = await gw.get_json(accepted["status_url"])
        assert status == 200
        if record["state"] != "running":
            break
        await asyncio.sleep(0.05)
    assert record["state"] == "succeeded", record
    assert record["pipeline"] == "shout"
    result = record["result"]
    assert result["body"] == "LATER" and result["content_type"] == "application/octet-stream"
    assert _stages(result["server_timing"]) == ["say", "loud", "again", "total"]


async def test_pipeline_metrics_count_runs_and_time_stages(start_gateway):
    gw = await start_gateway()
    await _ready(gw, TWO_STEPS)
    for _ in range(3):
        status, _, _ = await _invoke(gw, "twice", b"x", {})
        assert status == 200
    async with gw.session.get(f"{gw.url}/metrics") as r:
        text = await r.text()
    for stage in ("first", "second", "total"):
        line = f'trims_pipeline_stage_seconds_count{{pipeline="twice",stage="{stage}"}} 3.0'
        assert line in text, stage
    assert 'trims_pipeline_invocations_total{pipeline="twice",status="200"} 3.0' in text


def test_outcome_headers_are_case_insensitive_and_timing_names_are_tokens():
    outcome = Outcome(200, {"content-type": "application/json"}, b"{}")
    assert outcome.headers["Content-Type"] == "application/json"
    assert outcome.headers.get("CONTENT-TYPE") == "application/json"
    assert server_timing([("total", 0.001), ("a b", 0.002), ("total", 0.003)]) == (
        "step-total;dur=1.000, a-b;dur=2.000, total;dur=3.000"
    )
    assert parse_server_timing('db;dur=53, app;desc="x";dur=47.2, miss, cache;desc=hit') == {
        "db": 53.0,
        "app": 47.2,
    }
