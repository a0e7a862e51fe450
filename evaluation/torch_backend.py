"""PyTorch backend: run an ONNX graph node by node with ``torch.nn.functional`` (eager mode).

Covers the ops of the zoo models; weights become torch tensors once, at preparation. A layer
micro-benchmark is a one-node graph, so the same interpreter times a layer and a whole model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from trims.errors import ValidationError
from trims.evaluation.ort_backend import random_inputs

if TYPE_CHECKING:
    import onnx
    import torch

OpFn = Callable[[list[Any], dict[str, Any]], list[Any]]


def framework_version() -> str:
    import torch

    return str(torch.__version__)


def _pads(attrs: dict[str, Any], dims: int) -> tuple[list[int], bool]:
    pads = list(attrs.get("pads", [0] * (2 * dims)))
    begin, end = pads[:dims], pads[dims:]
    return begin, begin == end


def _pad_input(
    x: torch.Tensor, attrs: dict[str, Any], value: float
) -> tuple[torch.Tensor, list[int]]:
    import torch.nn.functional as F

    dims = len(attrs.get("kernel_shape", x.shape[2:]))
    begin, symmetric = _pads(attrs, dims)
    if symmetric:
        return x, begin
    pads = list(attrs["pads"])
    flat: list[int] = []
    for d in reversed(range(dims)):
        flat += [pads[d], pads[d + dims]]
    return F.pad(x, flat, value=value), [0] * dims


def _ops() -> dict[str, OpFn]:
    import torch
    import torch.nn.functional as F

    def conv(x: list[Any], a: dict[str, Any]) -> list[Any]:
        inp, pad = _pad_input(x[0], a, 0.0)
        bias = x[2] if len(x) > 2 else None
        return [
            F.conv2d(
                inp,
                x[1],
                bias,
                list(a.get("strides", [1, 1])),
                pad,
                list(a.get("dilations", [1, 1])),
                int(a.get("group", 1)),
            )
        ]

    def maxpool(x: list[Any], a: dict[str, Any]) -> list[Any]:
        inp, pad = _pad_input(x[0], a, float("-inf"))
        return [
            F.max_pool2d(
                inp,
                list(a["kernel_shape"]),
                list(a.get("strides", [1, 1])),
                pad,
                ceil_mode=bool(a.get("ceil_mode", 0)),
            )
        ]

    def avgpool(x: list[Any], a: dict[str, Any]) -> list[Any]:
        def pool(t: torch.Tensor) -> torch.Tensor:
            inp, pad = _pad_input(t, a, 0.0)
            return F.avg_pool2d(
                inp,
                list(a["kernel_shape"]),
                list(a.get("strides", [1, 1])),
                pad,
                ceil_mode=bool(a.get("ceil_mode", 0)),
                count_include_pad=bool(a.get("count_include_pad", 0)),
            )

        out = pool(x[0])
        if _pads(a, 2)[1] or a.get("count_include_pad", 0):
            return [out]
        # explicit asymmetric padding made the zeros count: divide by the share that is real
        return [out / pool(torch.ones_like(x[0][:1, :1]))]

    def gemm(x: list[Any], a: dict[str, Any]) -> list[Any]:
        A = x[0].t() if a.get("transA", 0) else x[0]
        B = x[1].t() if a.get("transB", 0) else x[1]
        out = float(a.get("alpha", 1.0)) * (A @ B)
        if len(x) > 2:
            out = out + float(a.get("beta", 1.0)) * x[2]
        return [out]

    def bn(x: list[Any], a: dict[str, Any]) -> list[Any]:
        return [
            F.batch_norm(x[0], x[3], x[4], x[1], x[2], False, 0.0, float(a.get("epsilon", 1e-5)))
        ]

    def lrn(x: list[Any], a: dict[str, Any]) -> list[Any]:
        return [
            F.local_response_norm(
                x[0],
                int(a["size"]),
                float(a.get("alpha", 1e-4)),
                float(a.get("beta", 0.75)),
                float(a.get("bias", 1.0)),
            )
        ]

    def total(x: list[Any], a: dict[str, Any]) -> list[Any]:
        out = x[0]
        for t in x[1:]:
            out = out + t
        return [out]

    def softmax(x: list[Any], a: dict[str, Any]) -> list[Any]:
        axis = int(a.get("axis", 1))
        shape = x[0].shape
        flat = x[0].reshape(int(np.prod(shape[:axis])), -1)
        return [torch.softmax(flat, dim=1).reshape(shape)]

    def reshape(x: list[Any], a: dict[str, Any]) -> list[Any]:
        target = [int(v) for v in x[1].tolist()]
        target = [x[0].shape[i] if v == 0 else v for i, v in enumerate(target)]
        return [x[0].reshape(target)]

    return {
        "Conv": conv,
        "MaxPool": maxpool,
        "AveragePool": avgpool,
        "GlobalAveragePool": lambda x, a: [F.adaptive_avg_pool2d(x[0], 1)],
        "Gemm": gemm,
        "MatMul": lambda x, a: [x[0] @ x[1]],
        "BatchNormalization": bn,
        "LRN": lrn,
        "Relu": lambda x, a: [F.relu(x[0])],
        "Sigmoid": lambda x, a: [torch.sigmoid(x[0])],
        "Add": lambda x, a: [x[0] + x[1]],
        "Mul": lambda x, a: [x[0] * x[1]],
        "Sum": total,
        "Concat": lambda x, a: [torch.cat(x, dim=int(a["axis"]))],
        "Softmax": softmax,
        "Reshape": reshape,
        "Flatten": lambda x, a: [x[0].flatten(int(a.get("axis", 1)))],
        "Transpose": lambda x, a: [x[0].permute(list(a["perm"])).contiguous()],
        "Dropout": lambda x, a: [x[0]],
        "Identity": lambda x, a: [x[0]],
    }


def interpreter(model: onnx.ModelProto, name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A function from input tensors to all tensors, running the graph node by node."""
    import torch
    from onnx import helper, numpy_helper

    ops = _ops()
    graph = model.graph
    for index, node in enumerate(graph.node):
        if node.op_type not in ops:
            raise ValidationError(
                f"model {name!r}: node {node.name or index!r} op {node.op_type!r} has no PyTorch "
                f"mapping; supported: {', '.join(sorted(ops))}"
            )
    weights: dict[str, Any] = {
        t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in graph.initializer
    }
    plan = [
        (
            ops[node.op_type],
            list(node.input),
            list(node.output),
            {a.name: helper.get_attribute_value(a) for a in node.attribute},
        )
        for node in graph.node
    ]

    def run(inputs: dict[str, Any]) -> dict[str, Any]:
        values = {**weights, **inputs}
        with torch.inference_mode():
            for fn, names, outputs, attrs in plan:
                results = fn([values[i] for i in names if i], attrs)
                for key, value in zip(outputs, results, strict=False):
                    values[key] = value
        return values

    return run


def runner(model: onnx.ModelProto, threads: int, name: str) -> Callable[[], object]:
    """A callable that runs ``model`` once in eager PyTorch on fixed random inputs."""
    import torch

    torch.set_num_threads(threads)
    run = interpreter(model, name)
    feeds = {k: torch.from_numpy(v) for k, v in random_inputs(model).items()}
    return lambda: run(feeds)


def run_outputs(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], name: str
) -> list[np.ndarray]:
    """Run ``model`` once on ``feeds`` and return its graph outputs as NumPy arrays."""
    import torch

    values = interpreter(model, name)({k: torch.from_numpy(v) for k, v in feeds.items()})
    return [values[o.name].numpy() for o in model.graph.output]
