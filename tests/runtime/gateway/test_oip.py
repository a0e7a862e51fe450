"""The Open Inference Protocol through a standard client (tritonclient.http) and raw JSON."""

from __future__ import annotations

import asyncio
import json

import numpy as np

from tests.fixtures.gateway import doubler_spec, echo_spec
from trims.oip import HEADER_LENGTH, platform_of

W = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
B = np.array([0.5, -1.0, 2.0], dtype=np.float32)


def linear_spec() -> dict[str, object]:
    """A function serving the store's model 'lin' (seeded into the daemon by the tests)."""
    spec = echo_spec("linear")
    spec["models"] = [{"name": "lin", "framework": "numpy"}]
    spec["serves"] = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [-1, 3]},
            {"name": "n", "datatype": "INT64", "shape": [-1]},
        ],
    }
    return spec


def _triton_round_trip(url: str, x: np.ndarray) -> tuple[dict[str, object], np.ndarray, np.ndarray]:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url=url.removeprefix("http://"))
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("linear")
        meta = client.get_model_metadata("linear")
        binary_in = httpclient.InferInput("x", list(x.shape), "FP32")
        binary_in.set_data_from_numpy(x, binary_data=True)
        out = client.infer(
            "linear",
            [binary_in],
            outputs=[httpclient.InferRequestedOutput("y", binary_data=True)],
        )
        y_binary = out.as_numpy("y")
        json_in = httpclient.InferInput("x", list(x.shape), "FP32")
        json_in.set_data_from_numpy(x, binary_data=False)
        out = client.infer(
            "linear",
            [json_in],
            outputs=[httpclient.InferRequestedOutput("y", binary_data=False)],
        )
        y_json = out.as_numpy("y")
    finally:
        client.close()
    return meta, y_binary, y_json


async def test_triton_client_matches_the_direct_model_output(start_gateway, start_daemon):
    daemon = start_daemon(models={"lin": {"w": W, "b": B}})
    gw = await start_gateway(store_socket=daemon.socket)
    await gw.deploy(linear_spec())
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    meta, y_binary, y_json = await asyncio.to_thread(_triton_round_trip, gw.url, x)
    direct = x @ W + B
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    np.testing.assert_allclose(y_binary, direct, rtol=1e-6)
    np.testing.assert_allclose(y_json, direct, rtol=1e-6)


async def test_json_infer_and_clear_400s(start_gateway, start_daemon):
    daemon = start_daemon(models={"lin": {"w": W, "b": B}})
    gw = await start_gateway(store_socket=daemon.socket)
    await gw.deploy(linear_spec())
    url = f"{gw.url}/v2/models/linear/infer"
    good = {
        "id": "r1",
        "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [[1, 2, 3, 4]]}],
    }
    async with gw.session.post(url, json=good) as r:
        doc = await r.json()
        assert r.status == 200, doc
    assert doc["id"] == "r1" and doc["model_name"] == "linear"
    outputs = {o["name"]: o for o in doc["outputs"]}
    assert outputs["n"] == {"name": "n", "datatype": "INT64", "shape": [1], "data": [10]}
    np.testing.assert_allclose(
        outputs["y"]["data"], (np.array([[1, 2, 3, 4]]) @ W + B).ravel(), rtol=1e-6
    )

    def bad(**change: object) -> dict[str, object]:
        tensor = {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4], **change}
        return {"inputs": [tensor]}

    cases = [
        (bad(shape=[1, 3], data=[1, 2, 3]), "must have shape [-1, 4]"),
        (bad(shape=[1, 4], data=[1, 2, 3]), "needs 4 elements"),
        (bad(datatype="FP64"), "must be FP32"),
        (bad(datatype="FLOAT"), "not one of"),
        (bad(name="z"), "has no input 'z'"),
        (bad(data=["a", "b", "c", "d"]), "must be numbers"),
        ({"inputs": []}, "non-empty 'inputs'"),
        ({**bad(), "outputs": [{"name": "nope"}]}, "has no output 'nope'"),
    ]
    for body, message in cases:
        async with gw.session.post(url, json=body) as r:
            doc = await r.json()
            assert r.status == 400, (body, doc)
            assert message in doc["error"], (message, doc)
    async with gw.session.get(f"{gw.url}/v2/models/echo-none") as r:
        assert r.status == 404
    async with gw.session.get(f"{gw.url}/v2/models/linear/versions/7") as r:
        assert r.status == 404 and "no version '7'" in (await r.json())["error"]


def _x(values: list[float], **extra: object) -> dict[str, object]:
    return {"name": "x", "shape": [len(values)], "datatype": "FP32", **extra}


async def _post(gw, path: str, body: bytes, headers: dict[str, str] | None = None):
    async with gw.session.post(gw.url + path, data=body, headers=headers or {}) as r:
        return r.status, dict(r.headers), await r.read()


async def test_v2_errors_are_the_spec_string_and_v1_keeps_its_shape(start_gateway):
    gw = await start_gateway()
    await gw.deploy(doubler_spec())
    for method, path, status in [
        ("GET", "/v2/models/nope", 404),
        ("GET", "/v2/no/such/route", 404),
        ("DELETE", "/v2/models/doubler", 405),
        ("POST", "/v2/models/doubler/infer", 400),
    ]:
        async with gw.session.request(method, gw.url + path, data=b"{") as r:
            doc = await r.json()
            assert r.status == status, (path, doc)
            assert set(doc) == {"error"} and isinstance(doc["error"], str) and doc["error"], doc
    async with gw.session.get(f"{gw.url}/v1/functions/nope") as r:
        doc = await r.json()
        assert r.status == 404 and doc["error"]["code"] == "not_found", doc


async def test_outputs_json_cannot_carry_are_refused_or_sent_binary(start_gateway):
    gw = await start_gateway()
    await gw.deploy(doubler_spec())
    x = np.array([1.0, np.nan, np.inf], dtype=np.float32)
    head = json.dumps(
        {
            "inputs": [_x([0, 0, 0], parameters={"binary_data_size": x.nbytes})],
            "outputs": [{"name": "y"}],
        }
    ).encode()
    binary = {HEADER_LENGTH: str(len(head))}
    status, _, body = await _post(gw, "/v2/models/doubler/infer", head + x.tobytes(), binary)
    message = json.loads(body)["error"]
    assert status == 400 and "NaN or Infinity" in message, message
    assert '"binary_data": true' in message

    head = json.dumps(
        {
            "inputs": [_x([0, 0, 0], parameters={"binary_data_size": x.nbytes})],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    ).encode()
    status, headers, body = await _post(
        gw, "/v2/models/doubler/infer", head + x.tobytes(), {HEADER_LENGTH: str(len(head))}
    )
    assert status == 200, body
    n = int(headers[HEADER_LENGTH])
    np.testing.assert_array_equal(np.frombuffer(body[n:], np.float32), x * 2)

    plain = json.dumps({"inputs": [_x([1.0], data=[1.0])], "outputs": [{"name": "raw"}]})
    status, _, body = await _post(gw, "/v2/models/doubler/infer", plain.encode())
    assert status == 400 and b"not UTF-8" in body and b"\\ufffd" not in body, body
    wanted = {"name": "raw", "parameters": {"binary_data": True}}
    both = json.dumps({"inputs": [_x([1.0], data=[1.0])], "outputs": [wanted]})
    status, headers, body = await _post(gw, "/v2/models/doubler/infer", both.encode())
    assert status == 200, body
    n = int(headers[HEADER_LENGTH])
    blob = body[n:]
    assert blob[4:] == b"\xff\xfe" + np.float32(1.0).tobytes()


async def test_request_checks_of_the_spec(start_gateway):
    gw = await start_gateway()
    await gw.deploy(doubler_spec())
    url = "/v2/models/doubler/infer"
    both = {"inputs": [_x([1.0], data=[1.0], parameters={"binary_data_size": 4})]}
    head = json.dumps(both).encode()
    status, _, body = await _post(
        gw, url, head + np.float32(1).tobytes(), {HEADER_LENGTH: str(len(head))}
    )
    assert status == 400 and b"has both 'data' and binary_data_size" in body, body

    for request_id in (7, 2.5, "r-1"):
        doc = {"id": request_id, "inputs": [_x([1.0], data=[1.0])], "outputs": [{"name": "y"}]}
        status, _, body = await _post(gw, url, json.dumps(doc).encode())
        assert status == 200, body
        echoed = json.loads(body)["id"]
        assert echoed == request_id and type(echoed) is type(request_id)
    for bad_id in ({"no": 1}, True, float("nan")):
        doc = {"id": bad_id, "inputs": [_x([1.0], data=[1.0])]}
        status, _, body = await _post(gw, url, json.dumps(doc).encode())
        assert status == 400 and b"'id' must be a string" in body, body

    x = np.array([1.0, 2.0], dtype=np.float32)
    head = json.dumps({"inputs": [_x([0, 0], parameters={"binary_data_size": 8})]}).encode()
    status, _, body = await _post(gw, url, head + x.tobytes())  # no header
    message = json.loads(body)["error"]
    assert status == 400 and f"no {HEADER_LENGTH} header" in message, message
    assert f"'{HEADER_LENGTH}: {len(head)}'" in message
    status, _, body = await _post(gw, url, head)  # binary_data_size, no binary part, no header
    assert status == 400 and HEADER_LENGTH.encode() in body, body


async def test_platform_names_the_backend(start_gateway, start_daemon):
    daemon = start_daemon(models={"lin": {"w": W, "b": B}})
    gw = await start_gateway(store_socket=daemon.socket)
    await gw.deploy(linear_spec())
    await gw.deploy(doubler_spec())
    assert (await gw.get_json("/v2/models/linear"))[1]["platform"] == "numpy"
    assert (await gw.get_json("/v2/models/doubler"))[1]["platform"] == "trims"
    assert platform_of(["onnxruntime"]) == "onnxruntime_onnx"
    assert platform_of(["torch", "numpy"]) == "pytorch_libtorch"
    assert platform_of(["onnxruntime"], "tensorrt_plan") == "tensorrt_plan"
    assert platform_of([]) == "trims"
