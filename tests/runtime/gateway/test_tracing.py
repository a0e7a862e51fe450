"""Traced invocations: ``trims-trace-level`` through a real gateway and real workers.

A torch function (a small CNN built in ``init``) invoked with ``trims-trace-level: layer``
answers with its own body plus ``trims-trace-id``; the gateway keeps one trace tree (gateway
service spans > worker span > model span > aten operators) served as JSON and as a Chrome
trace, and exports the same tree over OTLP to a test-owned receiver. An ONNX model from the
store, run through ``model.onnx_session()``, shows its ORT node spans under the model span the
same way; a session the handler builds itself is named as the reason layers are missing.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import tempfile
import textwrap
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.gateway import ADMIN, RunningGateway
from trims.runtime.settings import Token
from trims.tracing.levels import Level
from trims.tracing.spans import Span, Trace

TRACER = Token("tracer-secret-1", frozenset({"invoke:*", "trace"}), "tracer")
INVOKER = Token("invoker-secret-1", frozenset({"invoke:*"}), "invoker")
TOKENS = (ADMIN, TRACER, INVOKER)

CNN = """
import torch

def init(ctx):
    torch.manual_seed(0)
    ctx.state["net"] = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(8, 4),
    ).eval()

def handler(request, ctx):
    if request.headers.get("x-sabotage"):
        def broken(*args, **kwargs):
            raise RuntimeError("torch.profiler sabotaged by the test")
        torch.profiler.profile = broken
        return {"sabotaged": True}
    with torch.no_grad():
        out = ctx.state["net"](torch.ones(1, 3, 16, 16))
    return {"out": [round(v, 4) for v in out[0].tolist()]}
"""

ECHO = """
def handler(request, ctx):
    return request.body
"""


def write_function(root: Path, name: str, code: str) -> dict[str, Any]:
    folder = root / f"code-{name}"
    folder.mkdir()
    (folder / "handler.py").write_text(textwrap.dedent(code))
    return {"name": name, "handler": "handler:handler", "code_dir": str(folder)}


def bearer(token: Token) -> dict[str, str]:
    return {"Authorization": f"Bearer {token.secret}"}


async def get(gw: RunningGateway, path: str, token: Token = TRACER) -> tuple[int, Any, Any]:
    async with gw.session.get(gw.url + path, headers=bearer(token)) as r:
        return r.status, r.headers, await r.json(content_type=None)


def chain(trace: Trace, leaf: Span) -> list[Span]:
    """``leaf`` and its ancestors, root first."""
    by_id = {s.span_id: s for s in trace.spans}
    out = [leaf]
    while out[-1].parent_id in by_id:
        out.append(by_id[out[-1].parent_id])
    return out[::-1]


def trace_headers(headers: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items() if k.lower().startswith("trims-trace-")}


def _otel_sdk_installed() -> bool:
    from opentelemetry import trace as otel_trace
    from opentelemetry.sdk.trace import TracerProvider

    return isinstance(otel_trace.get_tracer_provider(), TracerProvider)


async def test_layer_trace_is_one_tree_in_json_chrome_and_otlp(
    start_gateway: Callable[..., Awaitable[RunningGateway]], tmp_path: Path, otlp_receiver: Any
) -> None:
    gw = await start_gateway(tokens=TOKENS, otlp_endpoint=otlp_receiver.endpoint)
    await gw.deploy(write_function(tmp_path, "cnn", CNN))

    caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    status, headers, body = await gw.invoke(
        "cnn",
        headers={
            **bearer(TRACER),
            "Trims-Trace-Level": "LAYER",
            "traceparent": f"00-{caller_trace}-00f067aa0ba902b7-01",
        },
    )
    assert status == 200, body
    status, untraced, plain = await gw.invoke("cnn", headers=bearer(TRACER))
    assert status == 200, plain
    assert trace_headers(untraced) == {}
    assert body == plain, "the function's body is unchanged by tracing"
    assert headers["trims-trace-id"] == caller_trace
    assert headers["trims-trace-level"] == "layer"
    assert "trims-trace-error" not in headers

    status, _, doc = await get(gw, f"/v1/traces/{caller_trace}")
    assert status == 200, doc
    assert (doc["function"], doc["level"], doc["error"]) == ("cnn", "layer", None)
    trace = Trace.from_dict(doc)
    roots = [s for s in trace.spans if s.parent_id not in {x.span_id for x in trace.spans}]
    assert [r.name for r in roots] == ["gateway request"]
    if _otel_sdk_installed():
        # an earlier test of this process installed an SDK provider: the gateway's own
        # OpenTelemetry request span (a child of the caller's) is then the root's parent
        assert roots[0].parent_id not in (None, "00f067aa0ba902b7")
    else:
        assert roots[0].parent_id == "00f067aa0ba902b7", "the caller's span is the root's parent"
    convs = [s for s in trace.spans if s.attributes.get("op_type") == "aten::conv2d"]
    assert convs, [s.name for s in trace.spans]
    path = chain(trace, convs[0])
    assert [(s.level, s.track[0].split()[0]) for s in path[:4]] == [
        (Level.SERVICE, "gateway"),
        (Level.SERVICE, "gateway"),
        (Level.SERVICE, "worker"),
        (Level.MODEL, "worker"),
    ], [(s.name, s.level) for s in path]
    assert [s.name for s in path[:4]] == [
        "gateway request",
        "invoke cnn",
        "worker cnn",
        "handler cnn",
    ]
    assert all(s.level is Level.LAYER for s in path[4:])
    starts = [s for s in trace.spans if s.name == "instance start"]
    assert [chain(trace, s)[-2].name for s in starts] == ["queue"], "the cold start it waited for"

    status, headers, chrome = await get(gw, f"/v1/traces/{caller_trace}?format=chrome")
    assert status == 200
    assert f"{caller_trace}.trace.json" in headers["Content-Disposition"]
    names = {
        (e["name"], e["args"]["name"].split()[0])
        for e in chrome["traceEvents"]
        if e["ph"] == "M" and e["name"] in ("process_name", "thread_name")
    }
    assert {("process_name", "gateway"), ("process_name", "worker")} <= names
    assert ("thread_name", "event") in names
    assert {e["cat"] for e in chrome["traceEvents"] if e["ph"] == "X"} >= {
        "service",
        "model",
        "layer",
    }

    exported = await otlp_receiver.await_for(caller_trace, count=len(trace.spans))
    assert {s.level for s in exported.spans} >= {Level.SERVICE, Level.MODEL, Level.LAYER}
    assert {s.track[0].split()[0] for s in exported.spans} == {"gateway", "worker"}
    ids = {s.span_id for s in exported.spans}
    assert [s.name for s in exported.spans if s.parent_id not in ids] == ["gateway request"]

    status, headers, body = await gw.invoke(
        "cnn", headers={**bearer(TRACER), "trims-trace-level": "kernel"}
    )
    assert status == 200 and body == plain
    unavailable = headers["trims-trace-unavailable"]
    assert re.search(r"kernel=[^;]*CUDA", unavailable), unavailable
    assert re.fullmatch(r"[0-9a-f]{32}", headers["trims-trace-id"])

    async with gw.session.get(gw.url + "/metrics") as r:
        metrics = await r.text()
    assert 'trims_traced_invocations_total{function="cnn",level="layer"} 1.0' in metrics
    assert 'trims_traced_invocations_total{function="cnn",level="kernel"} 1.0' in metrics


async def test_a_failing_profiler_still_returns_the_result(
    start_gateway: Callable[..., Awaitable[RunningGateway]], tmp_path: Path
) -> None:
    gw = await start_gateway(tokens=TOKENS)
    await gw.deploy(write_function(tmp_path, "cnn", CNN))
    status, _, plain = await gw.invoke("cnn", headers=bearer(TRACER))
    assert status == 200, plain
    status, _, body = await gw.invoke("cnn", headers={**bearer(TRACER), "x-sabotage": "1"})
    assert json.loads(body) == {"sabotaged": True}

    status, headers, body = await gw.invoke(
        "cnn", headers={**bearer(TRACER), "trims-trace-level": "layer"}
    )
    assert status == 200 and body == plain
    assert "sabotaged by the test" in headers["trims-trace-error"]
    status, _, doc = await get(gw, f"/v1/traces/{headers['trims-trace-id']}")
    assert "sabotaged by the test" in doc["error"]
    assert {s["level"] for s in doc["spans"]} == {"service", "model"}
    async with gw.session.get(gw.url + "/metrics") as r:
        assert 'trims_trace_failures_total{function="cnn"} 1.0' in await r.text()


async def test_tracing_needs_the_trace_scope_and_a_known_level(
    start_gateway: Callable[..., Awaitable[RunningGateway]], tmp_path: Path
) -> None:
    gw = await start_gateway(tokens=TOKENS, anonymous_scopes=frozenset({"invoke:*"}))
    await gw.deploy(write_function(tmp_path, "echo", ECHO))

    status, headers, body = await gw.invoke(
        "echo", b"hi", headers={**bearer(INVOKER), "trims-trace-level": "layer"}
    )
    assert status == 403, body
    assert "trace" in json.loads(body)["error"]["message"]
    async with gw.session.post(
        f"{gw.url}/v1/functions/echo/invoke", data=b"hi", headers={"trims-trace-level": "layer"}
    ) as r:
        assert r.status == 401
    status, _, doc = await get(gw, "/v1/traces")
    assert (status, doc) == (200, {"traces": []}), "a refused request is not traced"
    status, _, _ = await get(gw, "/v1/traces", INVOKER)
    assert status == 403

    status, _, body = await gw.invoke(
        "echo", b"hi", headers={**bearer(TRACER), "trims-trace-level": "deep"}
    )
    assert status == 400
    message = json.loads(body)["error"]["message"]
    assert all(level in message for level in ("none", "model", "layer", "kernel", "full"))

    status, headers, body = await gw.invoke(
        "echo", b"hi", headers={**bearer(TRACER), "trims-trace-level": "none"}
    )
    assert (status, body, trace_headers(headers)) == (200, b"hi", {})

    status, headers, body = await gw.invoke(
        "echo", b"hi", headers={**bearer(TRACER), "trims-trace-level": "layer"}
    )
    assert (status, body) == (200, b"hi")
    assert "layer=" in headers["trims-trace-unavailable"], "no framework: said, not silent"
    status, _, doc = await get(gw, f"/v1/traces/{headers['trims-trace-id']}")
    assert [s["name"] for s in doc["spans"] if s["level"] == "model"] == ["handler echo"]
    status, _, _ = await get(gw, "/v1/traces/" + "0" * 32)
    assert status == 404


async def test_async_invocation_carries_its_trace_id(
    start_gateway: Callable[..., Awaitable[RunningGateway]], tmp_path: Path
) -> None:
    gw = await start_gateway(tokens=TOKENS)
    await gw.deploy(write_function(tmp_path, "echo", ECHO))
    async with gw.session.post(
        f"{gw.url}/v1/functions/echo/invoke?async=true",
        data=b"hi",
        headers={**bearer(TRACER), "trims-trace-level": "model"},
    ) as r:
        assert r.status == 202
        trace_id = r.headers["trims-trace-id"]
        location = r.headers["Location"]
    doc: dict[str, Any] = {}
    for _ in range(400):
        status, _, doc = await get(gw, location)
        if doc["state"] != "running":
            break
        await asyncio.sleep(0.05)
    assert doc["state"] == "succeeded", doc
    assert doc["result"]["trace"]["trims-trace-id"] == trace_id
    status, _, trace = await get(gw, f"/v1/traces/{trace_id}")
    assert status == 200 and trace["level"] == "model"


LINEAR = """
import numpy as np
import torch

def init(ctx):
    torch.manual_seed(0)
    ctx.state["net"] = torch.nn.Linear(4, 3).eval()

def handler(request, ctx):
    return b""

def infer(inputs, ctx):
    with torch.no_grad():
        y = ctx.state["net"](torch.from_numpy(np.array(inputs["x"], dtype=np.float32)))
    return {"y": y.numpy()}
"""


async def test_open_inference_protocol_infer_is_traced(
    start_gateway: Callable[..., Awaitable[RunningGateway]], tmp_path: Path
) -> None:
    gw = await start_gateway(tokens=TOKENS)
    spec = write_function(tmp_path, "linear", LINEAR)
    spec["serves"] = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}],
    }
    await gw.deploy(spec)
    request = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    answers = []
    for level in ("layer", None):
        headers = {**bearer(TRACER), **({"trims-trace-level": level} if level else {})}
        async with gw.session.post(
            f"{gw.url}/v2/models/linear/infer", json=request, headers=headers
        ) as r:
            assert r.status == 200, await r.text()
            answers.append((await r.json(), trace_headers(r.headers)))
    (traced, traced_headers), (plain, plain_headers) = answers
    assert traced == plain and plain_headers == {}
    status, _, doc = await get(gw, f"/v1/traces/{traced_headers['trims-trace-id']}")
    assert status == 200, doc
    trace = Trace.from_dict(doc)
    linear = [s for s in trace.spans if s.attributes.get("op_type") == "aten::linear"]
    assert linear, [s.name for s in trace.spans]
    assert [s.name for s in chain(trace, linear[0])[:4]] == [
        "gateway request",
        "infer linear",
        "worker linear",
        "infer linear",
    ]


ORT_CNN = """
import tempfile

import numpy as np

def init(ctx):
    ctx.state["session"] = ctx.models["model"].onnx_session()

def handler(request, ctx):
    session = ctx.state["session"]
    if request.headers.get("x-probe"):
        return {"tmp": tempfile.gettempdir(), "profiling": session.session.end_profiling()}
    y = session.run(None, {"x": np.ones((1, 3, 16, 16), np.float32)})[0]
    return {"y": [round(float(v), 3) for v in y[0]]}
"""

OWN_ORT = """
import numpy as np
import onnxruntime
from onnx import TensorProto, helper

def init(ctx):
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    ctx.state["session"] = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )

def handler(request, ctx):
    y = ctx.state["session"].run(None, {"x": np.array([-1.0, 2.0], np.float32)})[0]
    return {"y": y.tolist()}
"""


@pytest.fixture
def worker_tmp() -> Iterator[Path]:
    """A temp dir for the function's workers (TMPDIR): under /tmp, so the worker's user can
    reach it, and the test's own, so a profile left there is seen."""
    folder = Path(tempfile.mkdtemp(prefix="trims-test-worker-tmp-"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


async def test_an_onnx_runtime_function_from_the_store_shows_its_node_spans(
    start_gateway: Callable[..., Awaitable[RunningGateway]],
    start_daemon: Callable[..., Any],
    tmp_path: Path,
    otlp_receiver: Any,
    worker_tmp: Path,
) -> None:
    onnx = pytest.importorskip("onnx")
    from tests.fixtures.models import small_cnn
    from trims.runtime.client import StoreClient

    daemon = start_daemon()
    source = tmp_path / "cnn.onnx"
    onnx.save(small_cnn(), str(source))
    with StoreClient(daemon.socket) as admin:
        admin.add("cnn-onnx", source)
    gw = await start_gateway(
        tokens=TOKENS, store_socket=daemon.socket, otlp_endpoint=otlp_receiver.endpoint
    )
    spec = write_function(tmp_path, "ortcnn", ORT_CNN)
    spec["models"] = [{"name": "cnn-onnx", "alias": "model"}]
    spec["env"] = {"TMPDIR": str(worker_tmp)}
    await gw.deploy(spec)

    status, headers, body = await gw.invoke(
        "ortcnn", headers={**bearer(TRACER), "trims-trace-level": "layer"}
    )
    assert status == 200, body
    assert "trims-trace-unavailable" not in headers and "trims-trace-error" not in headers
    trace_id = headers["trims-trace-id"]
    status, _, doc = await get(gw, f"/v1/traces/{trace_id}")
    assert status == 200, doc
    assert (doc["level"], doc["unavailable"], doc["error"]) == ("layer", {}, None)
    trace = Trace.from_dict(doc)
    convs = [s for s in trace.spans if s.attributes.get("op_type") == "Conv"]
    assert len(convs) == 1, [(s.name, s.attributes.get("op_type")) for s in trace.spans]
    path = chain(trace, convs[0])
    assert [(s.name, s.level) for s in path] == [
        ("gateway request", Level.SERVICE),
        ("invoke ortcnn", Level.SERVICE),
        ("worker ortcnn", Level.SERVICE),
        ("handler ortcnn", Level.MODEL),
        (convs[0].name, Level.LAYER),
    ]
    assert path[-1].track[0] == path[-2].track[0], "the node ran in the worker process"
    ops = {s.attributes.get("op_type") for s in trace.spans if s.level is Level.LAYER}
    assert {"Conv", "Gemm", "MatMul"} <= ops, ops
    (setup,) = [s for s in trace.spans if s.name == "profiled session cnn-onnx"]
    assert chain(trace, setup)[-2].name == "handler ortcnn"

    exported = await otlp_receiver.await_for(trace_id, count=len(trace.spans))
    exported_convs = [s for s in exported.spans if s.attributes.get("op_type") == "Conv"]
    assert [s.name for s in chain(exported, exported_convs[0])] == [s.name for s in path]

    status, untraced, plain = await gw.invoke("ortcnn", headers=bearer(TRACER))
    assert (status, plain) == (200, body), "the same answer, traced or not"
    assert trace_headers(untraced) == {}
    status, _, probe = await gw.invoke("ortcnn", headers={**bearer(TRACER), "x-probe": "1"})
    assert json.loads(probe) == {"tmp": str(worker_tmp), "profiling": ""}, (
        "the worker's temp dir is the test's, and its session itself never profiled"
    )
    assert list(worker_tmp.iterdir()) == [], "no profile left in the worker's temp dir"


async def test_a_session_the_handler_builds_itself_is_named_as_the_reason(
    start_gateway: Callable[..., Awaitable[RunningGateway]], tmp_path: Path
) -> None:
    pytest.importorskip("onnx")
    gw = await start_gateway(tokens=TOKENS)
    await gw.deploy(write_function(tmp_path, "ownort", OWN_ORT))
    status, headers, body = await gw.invoke(
        "ownort", headers={**bearer(TRACER), "trims-trace-level": "layer"}
    )
    assert (status, json.loads(body)) == (200, {"y": [0.0, 2.0]})
    unavailable = headers["trims-trace-unavailable"]
    assert re.search(r"layer=[^;]*InferenceSession[^;]*onnx_session\(\)", unavailable), unavailable
    status, _, doc = await get(gw, f"/v1/traces/{headers['trims-trace-id']}")
    assert {s["level"] for s in doc["spans"]} == {"service", "model"}
