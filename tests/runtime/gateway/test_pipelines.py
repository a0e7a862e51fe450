"""Pipelines: a DAG of functions invoked as one request."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.gateway import echo_spec
from trims.errors import ValidationError
from trims.runtime.gateway.pipelines import parse_pipeline


async def test_diamond_pipeline_feeds_outputs_forward(start_gateway):
    gw = await start_gateway()
    await gw.deploy(echo_spec("echo"))
    await gw.deploy(echo_spec("upper", handler="gwfuncs:upper"))
    spec = {
        "name": "diamond",
        "steps": [
            {"name": "first", "function": "echo"},
            {"name": "shout", "function": "upper", "after": ["first"]},
            {"name": "same", "function": "echo", "after": ["first"]},
            {"name": "join", "function": "echo", "after": ["shout", "same"]},
        ],
    }
    async with gw.session.post(f"{gw.url}/v1/pipelines", json=spec) as r:
        assert r.status == 201
    async with gw.session.post(f"{gw.url}/v1/pipelines/diamond/invoke", data=b"hello") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("application/json")
        assert json.loads(await r.read()) == {"shout": "HELLO", "same": "hello"}
    async with gw.session.get(f"{gw.url}/v1/pipelines") as r:
        assert [p["name"] for p in (await r.json())["pipelines"]] == ["diamond"]


async def test_a_failing_step_names_itself(start_gateway):
    gw = await start_gateway()
    await gw.deploy(echo_spec("echo"))
    await gw.deploy(echo_spec("bad", handler="badinit:handler"))
    spec = {
        "name": "broken",
        "steps": [
            {"name": "a", "function": "echo"},
            {"name": "b", "function": "bad", "after": ["a"]},
        ],
    }
    async with gw.session.put(f"{gw.url}/v1/pipelines/broken", json=spec) as r:
        assert r.status == 201
    async with gw.session.post(f"{gw.url}/v1/pipelines/broken/invoke", data=b"x") as r:
        assert r.status == 502
        assert "step b (function bad)" in (await r.json())["error"]["message"]
    missing = {"name": "m", "steps": [{"name": "a", "function": "nope"}]}
    async with gw.session.post(f"{gw.url}/v1/pipelines", json=missing) as r:
        assert r.status == 422 and "undeployed function 'nope'" in await r.text()


def test_pipeline_specs_are_checked():
    with pytest.raises(ValidationError, match="cycle: a -> b -> a"):
        parse_pipeline(
            {
                "name": "p",
                "steps": [
                    {"name": "a", "function": "f", "after": ["b"]},
                    {"name": "b", "function": "f", "after": ["a"]},
                ],
            }
        )
    with pytest.raises(ValidationError, match="unknown step 'zz'"):
        parse_pipeline({"name": "p", "steps": [{"name": "a", "function": "f", "after": ["zz"]}]})
    with pytest.raises(ValidationError, match="defined twice"):
        parse_pipeline({"name": "p", "steps": [{"name": "a", "function": "f"}] * 2})
    spec = parse_pipeline(
        {
            "name": "p",
            "steps": [
                {"name": "b", "function": "f", "after": ["a"]},
                {"name": "a", "function": "g"},
            ],
        }
    )
    assert [s.name for s in spec.steps] == ["a", "b"] and spec.sinks == ("b",)
