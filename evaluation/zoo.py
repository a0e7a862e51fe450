"""The model zoo: the nine real model graphs shipped inside the ``onnx`` wheel.

``onnx/backend/test/data/light/`` holds AlexNet, DenseNet-121, Inception v1/v2, ResNet-50,
ShuffleNet, SqueezeNet, VGG-19 and ZFNet-512 with their real topology, but every weight is a
``ConstantOfShape`` node (a shape initializer and one fill value) so the files stay small.
:func:`materialize` turns each of those nodes into a real-size initializer, which gives a model
with the true parameter bytes and run time. Beside each model sits the expected output
(``light_<name>_output_0.pb``) that onnx's backend test computed for the deterministic input
``arange(n) / n``; :func:`check` runs the materialized model on that input and compares.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trims.errors import CorruptModel, NotFound, ValidationError

if TYPE_CHECKING:
    import onnx

log = logging.getLogger(__name__)

#: zoo name -> (file stem inside the light folder, relative tolerance used by onnx's own test)
_MODELS: dict[str, tuple[str, float]] = {
    "alexnet": ("bvlc_alexnet", 1e-3),
    "densenet121": ("densenet121", 2e-3),
    "inception_v1": ("inception_v1", 1e-3),
    "inception_v2": ("inception_v2", 1e-3),
    "resnet50": ("resnet50", 1e-3),
    "shufflenet": ("shufflenet", 1e-3),
    "squeezenet": ("squeezenet", 1e-3),
    "vgg19": ("vgg19", 1e-3),
    "zfnet512": ("zfnet512", 1e-3),
}


@dataclass(frozen=True)
class CheckResult:
    """How a materialized model's output compares with the stored expected output."""

    name: str
    max_abs_diff: float
    rtol: float
    ok: bool


def zoo_names() -> list[str]:
    """The names :func:`materialize` accepts, in alphabetical order."""
    return sorted(_MODELS)


def zoo_dir() -> Path:
    """The folder in the installed onnx wheel that holds the light models."""
    import onnx

    return Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


def _stem(name: str) -> tuple[str, float]:
    try:
        return _MODELS[name]
    except KeyError:
        raise NotFound(f"no zoo model {name!r}; choose from {', '.join(zoo_names())}") from None


def model_path(name: str) -> Path:
    """Path of the light (weight-less) model file for ``name``."""
    stem, _ = _stem(name)
    path = zoo_dir() / f"light_{stem}.onnx"
    if not path.is_file():
        raise NotFound(f"zoo model {name!r} is missing at {path}; reinstall the onnx wheel")
    return path


def materialize(name: str) -> onnx.ModelProto:
    """Load zoo model ``name`` with every ConstantOfShape weight turned into an initializer.

    The returned model has one graph input per real input (the data tensor), real-size weights
    (filled with the constant the light file stores) and no ConstantOfShape nodes.
    """
    import onnx

    path = model_path(name)
    try:
        model = onnx.load(str(path))
    except Exception as e:
        raise CorruptModel(f"zoo model {name!r} at {path} cannot be parsed: {e}") from e
    model.graph.name = name
    return materialize_constants(model, name)


def materialize_constants(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """Replace ConstantOfShape nodes fed by initializers with initializers of that shape.

    Initializers no node reads (the shapes, unused blobs) are dropped, and graph inputs that
    name initializers (the pre-IR-4 convention) are removed so only real inputs remain.
    """
    from onnx import numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    keep: list[onnx.NodeProto] = []
    new_inits: list[onnx.TensorProto] = []
    for node in graph.node:
        if node.op_type != "ConstantOfShape" or node.input[0] not in inits:
            keep.append(node)
            continue
        shape = numpy_helper.to_array(inits[node.input[0]]).astype(np.int64)
        fill = np.zeros(1, dtype=np.float32)
        for attr in node.attribute:
            if attr.name == "value":
                fill = numpy_helper.to_array(attr.t)
        value = np.full(tuple(int(d) for d in shape), fill.reshape(-1)[0], dtype=fill.dtype)
        new_inits.append(numpy_helper.from_array(value, node.output[0]))
    still_used = {i for n in keep for i in n.input}
    drop = {t.name for t in graph.initializer if t.name not in still_used}
    remaining = [t for t in graph.initializer if t.name not in drop]
    del graph.node[:]
    graph.node.extend(keep)
    del graph.initializer[:]
    graph.initializer.extend(remaining + new_inits)
    init_names = {t.name for t in graph.initializer}
    real_inputs = [i for i in graph.input if i.name not in init_names and i.name not in drop]
    del graph.input[:]
    graph.input.extend(real_inputs)
    log.debug(
        "model %s: %d ConstantOfShape weights materialized as initializers", name, len(new_inits)
    )
    return model


def reference_input(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The deterministic input onnx's backend test used: ``arange(n) / n`` in the input shape."""
    feeds: dict[str, np.ndarray] = {}
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        shape = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in dims)
        n = int(np.prod(shape))
        feeds[value.name] = (np.arange(n).reshape(shape) / n).astype(np.float32)
    return feeds


def expected_output(name: str) -> np.ndarray:
    """The stored expected output ``light_<stem>_output_0.pb`` for zoo model ``name``."""
    import onnx
    from onnx import numpy_helper

    stem, _ = _stem(name)
    path = zoo_dir() / f"light_{stem}_output_0.pb"
    tensor = onnx.TensorProto()
    try:
        tensor.ParseFromString(path.read_bytes())
    except Exception as e:
        raise CorruptModel(f"expected output of zoo model {name!r} at {path}: {e}") from e
    return np.asarray(numpy_helper.to_array(tensor))


def check(name: str, model: onnx.ModelProto | None = None) -> CheckResult:
    """Run the materialized model in ONNX Runtime and compare with the stored output."""
    import onnxruntime as ort

    model = materialize(name) if model is None else model
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    try:
        session = ort.InferenceSession(
            model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
        )
    except Exception as e:
        raise ValidationError(f"zoo model {name!r} does not load in ONNX Runtime: {e}") from e
    (out,) = session.run([model.graph.output[0].name], reference_input(model))
    expected = expected_output(name)
    _, rtol = _stem(name)
    diff = float(np.max(np.abs(np.asarray(out) - expected)))
    ok = bool(np.allclose(out, expected, rtol=rtol, atol=1e-7))
    return CheckResult(name=name, max_abs_diff=diff, rtol=rtol, ok=ok)
