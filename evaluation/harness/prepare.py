"""Models made here, reproducibly by seed: the ``prepare:<name>`` builders of the manifests.

- ``digits-mlp``: a scikit-learn MLPClassifier (64-64-10, ReLU, seed 0) trained on the digits
  training split, exported to ONNX (MatMul/Add/Relu/Softmax). Its framework-native reference
  accuracy is scikit-learn's own ``predict`` on the same test samples (:func:`digits_reference`).
- ``als-ml100k``: implicit ALS (``trims.kernels.als``, seed 0) on the MovieLens-100k training
  split, exported to ONNX as ``scores = X[user] @ Y^T + seen[user]``, where ``seen`` is -1e9 on
  the user's training items so that top-k recommends unseen items only.

:func:`build` writes the ONNX file into a folder and returns its path; the same seed and the same
library versions give the same bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trims.errors import NotFound

if TYPE_CHECKING:
    import onnx

__all__ = ["ALS", "BUILDERS", "AlsSettings", "als_reference", "build", "digits_reference"]

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


BUILDERS: dict[str, Callable[[], onnx.ModelProto]] = {
    "digits-mlp": _digits_onnx,
    "als-ml100k": _als_onnx,
}


def build(name: str, out_dir: Path) -> Path:
    """Build ``prepare:<name>`` into ``out_dir/<name>.onnx`` (kept if already there)."""
    import onnx

    key = name.removeprefix("prepare:")
    builder = BUILDERS.get(key)
    if builder is None:
        raise NotFound(f"no prepare builder {name!r}; choose from {', '.join(sorted(BUILDERS))}")
    path = out_dir / f"{key}.onnx"
    if not path.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        from trims.config import write_atomic

        write_atomic(path, builder().SerializeToString())
        log.info("prepared %s at %s", key, path)
    onnx.checker.check_model(str(path))
    return path
