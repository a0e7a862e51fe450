"""Systems under test: DirectSUT (file and store) and GatewaySUT against a real gateway.

The model is a small ONNX MLP written by :func:`tiny_mlp` (seeded weights), so every answer can
be checked against the same arithmetic in NumPy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures.gateway import RunningGateway
from tests.fixtures.models import ONNX_HANDLER, samples, tiny_mlp, tiny_mlp_reference
from tests.fixtures.store import DaemonProcess
from trims.errors import NotFound, ValidationError
from trims.evaluation.harness.sut import (
    DirectSUT,
    GatewaySUT,
    decode_response,
    encode_request,
    onnx_function_spec,
)
from trims.runtime.gateway.tensors import HEADER_LENGTH, parse_request


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    return tiny_mlp(tmp_path / "tiny.onnx")


def test_direct_sut_answers_one_output_per_sample(model_file: Path, tmp_path: Path) -> None:
    sut = DirectSUT.onnx("tiny", model_file, socket_path=tmp_path / "no-store.sock")
    try:
        batch = samples(5)
        outputs = sut.predict(batch)
    finally:
        sut.close()
    assert len(outputs) == 5
    for x, out in zip(batch, outputs, strict=True):
        assert set(out) == {"probs"}
        np.testing.assert_allclose(out["probs"], tiny_mlp_reference(x), rtol=1e-5, atol=1e-6)


def test_direct_sut_splits_batches_for_a_fixed_batch_model(tmp_path: Path) -> None:
    fixed = tiny_mlp(tmp_path / "fixed.onnx", batch=1)
    sut = DirectSUT.onnx("fixed", fixed, socket_path=tmp_path / "no-store.sock")
    try:
        assert sut.max_batch == 1
        batch = samples(3)
        outputs = sut.predict(batch)
    finally:
        sut.close()
    got = np.stack([o["probs"] for o in outputs])
    np.testing.assert_allclose(got, tiny_mlp_reference(np.stack(batch)), rtol=1e-5, atol=1e-6)


def test_direct_sut_maps_the_model_from_the_store(
    model_file: Path, store_daemon: DaemonProcess
) -> None:
    added = store_daemon.request("add", admin=True, name="tiny", source=str(model_file))
    assert added["ok"], added
    sut = DirectSUT.onnx("tiny", socket_path=store_daemon.socket)
    try:
        batch = samples(4)
        outputs = sut.predict(batch)
    finally:
        sut.close()
    got = np.stack([o["probs"] for o in outputs])
    np.testing.assert_allclose(got, tiny_mlp_reference(np.stack(batch)), rtol=1e-5, atol=1e-6)


def test_direct_sut_without_store_or_source_says_so(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        DirectSUT.onnx("absent", tmp_path / "absent.onnx", socket_path=tmp_path / "no.sock")


def test_multi_input_samples_must_name_every_input() -> None:
    sut = DirectSUT("two", lambda feeds: {"y": feeds["a"] + feeds["b"]}, ["a", "b"])
    out = sut.predict([{"a": np.ones(2), "b": np.ones(2)}])
    np.testing.assert_array_equal(out[0]["y"], [2.0, 2.0])
    with pytest.raises(ValidationError, match="lack input"):
        sut.predict([{"a": np.ones(2)}])
    with pytest.raises(ValidationError, match="takes 2 inputs"):
        sut.predict([np.ones(2)])


def test_encoded_requests_parse_as_the_gateway_parses_them() -> None:
    feeds = {
        "x": np.arange(6, dtype=np.float32).reshape(2, 3),
        "ids": np.array([[1, 2]], dtype=np.int64),
    }
    for binary in (True, False):
        body, headers = encode_request(feeds, {"x": "FP32", "ids": "INT64"}, binary)
        parsed = parse_request(body, headers.get(HEADER_LENGTH))
        assert parsed.binary_default is binary
        for name, array in feeds.items():
            np.testing.assert_array_equal(parsed.inputs[name], array)
            assert parsed.inputs[name].dtype == array.dtype


def test_decode_response_reads_binary_and_json_outputs() -> None:
    from trims.runtime.gateway.tensors import InferRequest, encode_response

    outputs = {"a": np.arange(4, dtype=np.float32).reshape(2, 2), "b": np.array([7], np.int32)}
    for binary in (True, False):
        request = InferRequest(id=None, inputs={}, outputs=None, binary_default=binary)
        body, headers = encode_response("m", "1", request, outputs)
        decoded = decode_response(body, headers.get(HEADER_LENGTH))
        for name, array in outputs.items():
            np.testing.assert_array_equal(decoded[name], array)


async def test_gateway_sut_gives_the_direct_outputs(
    model_file: Path,
    tmp_path: Path,
    start_gateway: Callable[..., Awaitable[RunningGateway]],
) -> None:
    gw = await start_gateway()
    spec = onnx_function_spec("tiny-mlp", model_file, code_dir=ONNX_HANDLER)
    batch = samples(6, seed=3)

    def evaluate() -> tuple[list[Any], list[Any]]:
        direct = DirectSUT.onnx("tiny-mlp", model_file, socket_path=tmp_path / "no-store.sock")
        gateway = GatewaySUT.deploy(gw.url, spec)
        try:
            return direct.predict(batch), gateway.predict(batch)
        finally:
            direct.close()
            gateway.close()

    direct_out, gateway_out = await asyncio.to_thread(evaluate)
    assert len(gateway_out) == len(batch)
    for d, g in zip(direct_out, gateway_out, strict=True):
        assert set(g) == {"probs"}
        np.testing.assert_allclose(g["probs"], d["probs"], rtol=1e-6, atol=1e-7)
    status, _ = await gw.get_json("/v1/functions/tiny-mlp")
    assert status == 404, "close() removes the function deploy() made"


async def test_gateway_sut_for_an_unknown_model_is_not_found(
    start_gateway: Callable[..., Awaitable[RunningGateway]],
) -> None:
    gw = await start_gateway()
    with pytest.raises(NotFound, match="no model named"):
        await asyncio.to_thread(GatewaySUT, gw.url, "absent")


def test_torch_function_spec_carries_the_manifest_executor_and_threads() -> None:
    from trims.evaluation.harness.manifest import load_manifest, shipped_manifest_paths
    from trims.evaluation.harness.sut import torch_function_spec
    from trims.runtime.functions.spec import parse_spec

    path = next(p for p in shipped_manifest_paths() if p.stem == "torch-resnet18")
    manifest = load_manifest(path)
    spec = torch_function_spec(
        "eval-torch-resnet18", manifest.model_dump(mode="json"), input_name="data",
        input_dims=[3, 224, 224], output_name="logits", executor="docker", threads=2,
    )  # fmt: skip
    parsed = parse_spec(spec)
    assert parsed.executor == "docker" and parsed.resources.cpus == 2
    assert parsed.config["threads"] == 2 and parsed.config["manifest"]["name"] == "torch-resnet18"
    assert parsed.handler == "torch_model:handler"
    assert parsed.code_dir is not None and Path(parsed.code_dir, "torch_model.py").is_file()
    assert parsed.serves is not None and parsed.serves.inputs[0].shape == (-1, 3, 224, 224)
