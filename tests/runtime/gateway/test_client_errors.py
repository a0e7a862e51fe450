"""Handlers refuse a bad request with ClientError: the gateway answers its status and message
(not 502), counts it under that status and keeps the instance; in a pipeline too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.gateway import RunningGateway
from trims.runtime.functions import ClientError

STRICT = """
from trims.runtime.functions import ClientError


def handler(request, ctx):
    doc = request.json()
    if "texts" not in doc:
        raise ClientError("the body has no 'texts'; send {\\"texts\\": [...]}")
    if not isinstance(doc["texts"], list):
        raise ClientError("'texts' must be a list of strings", status=422)
    if doc["texts"] == ["boom"]:
        raise KeyError("boom")
    return {"n": len(doc["texts"])}
"""


async def _deploy_strict(gw: RunningGateway, code_dir: Path) -> None:
    code_dir.mkdir()
    (code_dir / "strict.py").write_text(STRICT)
    await gw.deploy({"name": "strict", "handler": "strict:handler", "code_dir": str(code_dir)})


async def _post(gw: RunningGateway, path: str, doc: Any) -> tuple[int, Any]:
    async with gw.session.post(gw.url + path, json=doc) as r:
        return r.status, json.loads(await r.read())


async def test_a_client_error_answers_its_status_and_keeps_the_instance(
    start_gateway: Any, tmp_path: Path
) -> None:
    gw = await start_gateway()
    await _deploy_strict(gw, tmp_path / "code")
    invoke = "/v1/functions/strict/invoke"
    assert await _post(gw, invoke, {"texts": ["a", "b"]}) == (200, {"n": 2})
    status, body = await _post(gw, invoke, {"text": "a"})
    assert status == 400
    assert body["error"]["code"] == "bad_request"
    assert body["error"]["message"] == "the body has no 'texts'; send {\"texts\": [...]}"
    status, body = await _post(gw, invoke, {"texts": "hi"})
    assert (status, body["error"]["code"]) == (422, "invalid")
    assert body["error"]["message"] == "'texts' must be a list of strings"
    # Any other exception is still the function's failure.
    status, body = await _post(gw, invoke, {"texts": ["boom"]})
    assert status == 502 and "KeyError" in body["error"]["message"]

    _, doc = await gw.get_json("/v1/functions/strict")
    assert [i["state"] for i in doc["status"]["instances"]] == ["ready"]
    assert await _post(gw, invoke, {"texts": ["c"]}) == (200, {"n": 1})
    metrics = gw.gateway.metrics.render().decode()
    assert 'trims_invocations_total{function="strict",status="400"} 1.0' in metrics
    assert 'trims_invocations_total{function="strict",status="422"} 1.0' in metrics


async def test_a_client_error_in_a_pipeline_step_names_the_step(
    start_gateway: Any, tmp_path: Path
) -> None:
    gw = await start_gateway()
    await _deploy_strict(gw, tmp_path / "code")
    spec = {"name": "checked", "steps": [{"name": "check", "function": "strict"}]}
    async with gw.session.put(f"{gw.url}/v1/pipelines/checked", json=spec) as r:
        assert r.status == 201
    status, body = await _post(gw, "/v1/pipelines/checked/invoke", {"texts": "hi"})
    assert status == 422
    assert body["error"]["message"] == (
        "pipeline checked step check (function strict): 'texts' must be a list of strings"
    )


def test_client_error_statuses_are_the_request_errors() -> None:
    assert ClientError("x").to_error().http_status == 400
    for status in (400, 404, 409, 413, 422):
        error = ClientError("fix it", status=status).to_error()
        assert (error.http_status, error.message) == (status, "fix it")
    with pytest.raises(ValueError, match="use one of 400, 404, 409, 413, 422"):
        ClientError("server trouble", status=500)
