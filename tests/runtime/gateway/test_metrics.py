"""Triton-style metrics on /metrics: per-model requests by protocol and outcome, samples vs
executions, end-to-end duration, pending requests, the gateway's own refusals, node and
process gauges, and no series left behind by a removed function."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.gateway import RunningGateway, echo_spec

StartGateway = Callable[..., Awaitable[RunningGateway]]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _serving_spec(name: str = "doubler", **scaling: Any) -> dict[str, Any]:
    spec = echo_spec(name, "metricsfuncs:handler", **scaling)
    spec["serves"] = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
        "versions": ["3"],
    }
    return spec


async def _scrape(gw: RunningGateway) -> Samples:
    async with gw.session.get(f"{gw.url}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def _infer(gw: RunningGateway, name: str, rows: list[list[float]]) -> int:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [len(rows), 2],
                        "data": [v for row in rows for v in row]}]}  # fmt: skip
    async with gw.session.post(f"{gw.url}/v2/models/{name}/infer", json=body) as r:
        await r.read()
        return r.status


async def test_requests_per_model_protocol_and_outcome(start_gateway: StartGateway) -> None:
    gw = await start_gateway()
    await gw.deploy(_serving_spec())
    assert await _infer(gw, "doubler", [[1, 2], [3, 4], [5, 6]]) == 200
    assert await _infer(gw, "doubler", [[1, 1]]) == 200
    assert await _infer(gw, "doubler", [[-1, 1]]) == 502
    status, _, _ = await gw.invoke("doubler", b"hi")
    assert status == 200
    samples = await _scrape(gw)
    labels = {"function": "doubler", "version": "3"}

    def requests(protocol: str, outcome: str) -> float:
        return _value(
            samples, "trims_inference_requests_total", protocol=protocol, outcome=outcome, **labels
        )

    assert (requests("v2", "success"), requests("v2", "failure")) == (2, 1)
    assert (requests("v1", "success"), requests("v1", "failure")) == (1, 0)
    # Samples: the batch dimension of each successful v2 request (3 + 1), 1 per v1 call.
    assert _value(samples, "trims_inference_count_total", **labels) == 5
    # Executions: every call that reached an instance, the failed one included.
    assert _value(samples, "trims_inference_exec_count_total", **labels) == 4
    v2_durations = _value(
        samples, "trims_inference_request_duration_seconds_count", protocol="v2", **labels
    )
    assert v2_durations == 3
    assert _value(samples, "trims_pending_requests", function="doubler") == 0


async def test_refusals_of_the_gateway_itself_are_counted(start_gateway: StartGateway) -> None:
    gw = await start_gateway()
    await gw.deploy(_serving_spec(max_body_bytes=1024))
    url = f"{gw.url}/v2/models/doubler/infer"
    async with gw.session.post(url, data=b"{not json") as r:
        assert r.status == 400
    async with gw.session.post(url, data=b"x" * 4096) as r:
        assert r.status == 413
    async with gw.session.get(f"{gw.url}/no/such/path") as r:
        assert r.status == 404
    samples = await _scrape(gw)
    route = "/v2/models/{name}/infer"
    for status in ("400", "413"):
        counted = _value(
            samples, "trims_http_requests_total", route=route, method="POST", status=status
        )
        assert counted == 1, status
    assert _value(samples, "trims_http_request_duration_seconds_count", route=route,
                  method="POST") == 2  # fmt: skip
    # An unmatched path is one series, whatever the path: a scanner cannot grow the set.
    assert (
        _value(samples, "trims_http_requests_total", route="unmatched", method="GET", status="404")
        == 1
    )
    assert not any("no/such" in str(key) for key in samples)
    # Refused before reaching the function: no inference was counted.
    assert _value(samples, "trims_inference_exec_count_total", function="doubler",
                  version="3") == 0  # fmt: skip


async def test_node_and_process_gauges(start_gateway: StartGateway) -> None:
    gw = await start_gateway()
    samples = await _scrape(gw)
    names = {name for name, _ in samples}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes",
            "process_open_fds"} <= names  # fmt: skip
    total = _value(samples, "trims_node_memory_total_bytes")
    used = _value(samples, "trims_node_memory_used_bytes")
    assert 0 < used < total
    assert 0.0 <= _value(samples, "trims_node_cpu_utilization") <= 1.0


async def test_a_removed_function_leaves_no_series(start_gateway: StartGateway) -> None:
    gw = await start_gateway()
    await gw.deploy(_serving_spec("gone"))
    await gw.deploy(_serving_spec("kept"))
    for name in ("gone", "kept"):
        assert await _infer(gw, name, [[1, 2]]) == 200
    async with gw.session.delete(f"{gw.url}/v1/functions/gone", headers=gw.headers()) as r:
        assert r.status in (200, 204), await r.text()
    samples = await _scrape(gw)
    functions = {dict(labels).get("function") for _, labels in samples}
    assert "kept" in functions
    assert "gone" not in functions, json.dumps(
        sorted(f"{n}{dict(k)}" for n, k in samples if dict(k).get("function") == "gone")
    )
