"""The Open Inference Protocol through a standard client (tritonclient.http) and raw JSON."""

from __future__ import annotations

import asyncio

import numpy as np

from tests.runtime.gateway.conftest import echo_spec

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
            assert message in doc["error"]["message"], (message, doc)
    async with gw.session.get(f"{gw.url}/v2/models/echo-none") as r:
        assert r.status == 404
    async with gw.session.get(f"{gw.url}/v2/models/linear/versions/7") as r:
        assert r.status == 404 and "no version '7'" in (await r.json())["error"]["message"]
