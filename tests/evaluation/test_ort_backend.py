"""Random inputs for a benchmark: the right types and shapes, reproducible, in range."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from trims.evaluation import ort_backend


def _model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "ids"], ["rows"]),
            helper.make_node("Add", ["x", "h"], ["y"]),
        ],
        "inputs",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 64, 64]),
            helper.make_tensor_value_info("h", TensorProto.FLOAT16, [1, 3, 64, 64]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 7]),
            helper.make_tensor_value_info("table", TensorProto.FLOAT, [8, 4]),
        ],
        [
            helper.make_tensor_value_info("rows", TensorProto.FLOAT, [1, 7, 4]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 64, 64]),
        ],
        initializer=[helper.make_tensor("table", TensorProto.FLOAT, [8, 4], [0.0] * 32)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_random_inputs_have_the_graph_types_and_shapes_and_skip_initializers() -> None:
    feeds = ort_backend.random_inputs(_model(), skip={"h"})
    assert set(feeds) == {"x", "ids"}  # "table" is an initializer, "h" was skipped
    assert feeds["x"].dtype == np.float32 and feeds["x"].shape == (1, 3, 64, 64)
    assert feeds["ids"].dtype == np.int64 and feeds["ids"].shape == (1, 7)


def test_random_float_inputs_are_uniform_on_minus_one_to_one_and_reproducible() -> None:
    model = _model()
    a = ort_backend.random_inputs(model, seed=3)
    b = ort_backend.random_inputs(model, seed=3)
    c = ort_backend.random_inputs(model, seed=4)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    assert not np.array_equal(a["x"], c["x"])
    x = a["x"]
    assert x.min() >= -1.0 and x.max() < 1.0
    # 12,288 uniform draws: mean 0 and variance 1/3, far from a normal draw's 1
    assert abs(float(x.mean())) < 0.05 and abs(float(x.var()) - 1 / 3) < 0.03
    assert a["h"].dtype == np.float16 and float(np.abs(a["h"]).max()) <= 1.0
