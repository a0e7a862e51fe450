"""ONNX Runtime adapter over a real sealed-memfd mapping: identical outputs, no weight copy.

The layout is built here the way the daemon's ONNX converter writes it: every initializer a
tensor, and the graph (initializers externalised to ``__trims__`` at their offsets) stored as
the uint8 tensor ``__onnx_graph__``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from trims.errors import ValidationError
from trims.layout import TensorSpec, plan
from trims.runtime.mapping import HostMapping

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from trims.runtime.adapters import onnxruntime as ort_adapter  # noqa: E402

MakeModel = Callable[..., HostMapping]


def small_cnn(hidden: int = 64) -> Any:
    """Conv -> Relu -> global pool -> Gemm -> MatMul: a real, small image classifier graph."""
    rng = np.random.default_rng(0)
    inits = {
        "conv.w": rng.standard_normal((16, 3, 3, 3)).astype(np.float32),
        "conv.b": rng.standard_normal(16).astype(np.float32),
        "fc.w": rng.standard_normal((hidden, 16)).astype(np.float32),
        "fc.b": rng.standard_normal(hidden).astype(np.float32),
        "head.w": rng.standard_normal((hidden, 10)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "conv.w", "conv.b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["g"], transB=1),
        helper.make_node("MatMul", ["g", "head.w"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "small_cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 10])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def store_layout(model: Any, make_model: MakeModel) -> HostMapping:
    """What the converter writes: initializers + the externalised graph, in a sealed memfd."""
    arrays = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    entries, _ = plan(TensorSpec(k, str(a.dtype), a.shape) for k, a in arrays.items())
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    for init, entry in zip(stripped.graph.initializer, entries, strict=True):
        init.ClearField("raw_data")
        init.ClearField("float_data")
        init.data_location = TensorProto.EXTERNAL
        for key, value in (
            ("location", "__trims__"),
            ("offset", entry.offset),
            ("length", entry.nbytes),
        ):
            item = init.external_data.add()
            item.key, item.value = key, str(value)
    arrays["__onnx_graph__"] = np.frombuffer(stripped.SerializeToString(), dtype=np.uint8)
    return make_model(arrays, framework="onnx", metadata={"onnx_graph": "__onnx_graph__"})


def _anonymous_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1])
    raise AssertionError("no Anonymous line in smaps_rollup")


def test_outputs_are_bit_identical_to_a_normal_session(make_model: MakeModel) -> None:
    model = small_cnn()
    mapping = store_layout(model, make_model)
    x = np.random.default_rng(1).standard_normal((4, 3, 16, 16)).astype(np.float32)
    normal = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    shared = ort_adapter.session(mapping)
    assert shared.run(None, {"x": x})[0].tobytes() == normal.run(None, {"x": x})[0].tobytes()


def test_without_prepacking_the_session_copies_no_weights(make_model: MakeModel) -> None:
    # fc.w + head.w: 26 * 1 Mi floats = 104 MiB, each tensor above glibc's mmap threshold so
    # a copy would show as new anonymous memory rather than hide in reused heap.
    model = small_cnn(hidden=1 << 20)
    mapping = store_layout(model, make_model)
    weights_kib = mapping.manifest.total_bytes // 1024
    x = np.random.default_rng(2).standard_normal((1, 3, 16, 16)).astype(np.float32)
    before = _anonymous_kib()
    shared = ort_adapter.session(mapping, prepack=False)
    grown = _anonymous_kib() - before
    assert grown < weights_kib // 4, (
        f"session creation allocated {grown} KiB for {weights_kib} KiB of weights"
    )
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_prepacking", "1")
    normal = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    assert shared.run(None, {"x": x})[0].tobytes() == normal.run(None, {"x": x})[0].tobytes()


def test_initializers_are_ort_values_over_the_mapping(make_model: MakeModel) -> None:
    mapping = store_layout(small_cnn(), make_model)
    values = ort_adapter.ort_values(mapping)
    assert set(values) == {"conv.w", "conv.b", "fc.w", "fc.b", "head.w"}
    base = mapping.address()
    for name, value in values.items():
        assert value.data_ptr() == base + mapping.manifest.tensor(name).offset


def test_a_model_without_a_graph_is_refused(make_model: MakeModel) -> None:
    mapping = make_model({"w": np.zeros(4, np.float32)}, framework="safetensors")
    with pytest.raises(ValidationError, match="no ONNX graph"):
        ort_adapter.session(mapping)
