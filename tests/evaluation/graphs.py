"""Hand-made ONNX graphs for the evaluation tests, with costs that are easy to compute by hand."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _weight(name: str, shape: tuple[int, ...], seed: int) -> onnx.TensorProto:
    rng = np.random.default_rng(seed)
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), name)


def _model(
    nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], x: list[int], name: str = "hand"
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x)],
        [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def conv_gemm() -> onnx.ModelProto:
    """x[1,3,8,8] -> Conv 4x3x3x3 pad 1 -> Relu -> MaxPool 2x2 -> Flatten -> Gemm 64->10."""
    nodes = [
        helper.make_node(
            "Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv"
        ),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], axis=1, name="flatten"),
        helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], transB=1, name="fc"),
    ]
    inits = [
        _weight("w", (4, 3, 3, 3), 0),
        _weight("b", (4,), 1),
        _weight("fw", (10, 64), 2),
        _weight("fb", (10,), 3),
    ]
    return _model(nodes, inits, [1, 3, 8, 8])


def residual(blocks: int = 3, channels: int = 8, name: str = "residual") -> onnx.ModelProto:
    """Stem conv then ``blocks`` identical residual blocks (conv-relu-conv, add, relu)."""
    nodes = [helper.make_node("Conv", ["x", "w0"], ["h0"], kernel_shape=[1, 1], name="stem")]
    inits = [_weight("w0", (channels, 3, 1, 1), 0)]
    for i in range(blocks):
        src, dst = f"h{i}", f"h{i + 1}"
        nodes += [
            helper.make_node(
                "Conv",
                [src, f"wa{i}"],
                [f"a{i}"],
                kernel_shape=[3, 3],
                pads=[1, 1, 1, 1],
                name=f"b{i}_conv_a",
            ),
            helper.make_node("Relu", [f"a{i}"], [f"ar{i}"], name=f"b{i}_relu_a"),
            helper.make_node(
                "Conv",
                [f"ar{i}", f"wb{i}"],
                [f"b{i}"],
                kernel_shape=[3, 3],
                pads=[1, 1, 1, 1],
                name=f"b{i}_conv_b",
            ),
            helper.make_node("Add", [f"b{i}", src], [f"s{i}"], name=f"b{i}_add"),
            helper.make_node("Relu", [f"s{i}"], [dst], name=f"b{i}_relu"),
        ]
        inits += [
            _weight(f"wa{i}", (channels, channels, 3, 3), 10 + i),
            _weight(f"wb{i}", (channels, channels, 3, 3), 20 + i),
        ]
    nodes.append(helper.make_node("GlobalAveragePool", [f"h{blocks}"], ["y"], name="gap"))
    return _model(nodes, inits, [1, 3, 16, 16], name)


def with_op(op_type: str) -> onnx.ModelProto:
    """x[1,4] -> ``op_type`` (no attributes) -> y."""
    return _model([helper.make_node(op_type, ["x"], ["y"], name="odd_node")], [], [1, 4])


def symbolic() -> onnx.ModelProto:
    """A Conv whose input has a symbolic channel dimension: its output shape is unknown."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu_sym")],
        "symbolic",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "C", 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def asymmetric_pools() -> onnx.ModelProto:
    """x[1,2,6,6] -> AveragePool 3x3 pads (0,0,1,1) -> MaxPool 2x2 pads (1,1,0,0) (Inception's)."""
    nodes = [
        helper.make_node(
            "AveragePool", ["x"], ["a"], kernel_shape=[3, 3], pads=[0, 0, 1, 1], name="avg"
        ),
        helper.make_node(
            "MaxPool",
            ["a"],
            ["y"],
            kernel_shape=[2, 2],
            pads=[1, 1, 0, 0],
            strides=[2, 2],
            name="max",
        ),
    ]
    return _model(nodes, [], [1, 2, 6, 6], "pools")
