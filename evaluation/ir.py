"""Model processor: a prepared ONNX model -> a DAG of layers with shapes, bytes and FLOPs.

FLOPs are counted as multiply-adds (one per MAC, the convention of the published "ResNet-50 is
4.1 GFLOPs" figure) for Conv, Gemm and MatMul; other compute ops count one per output element
per arithmetic step (BatchNormalization 2, Softmax 3, pooling one per window element, LRN one
per window element); data movement (Reshape, Concat, Transpose, ...) counts 0. Memory traffic is
the bytes of activations read, parameters read and outputs written.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trims.errors import ValidationError

if TYPE_CHECKING:
    import onnx

Shape = tuple[int, ...]

_ELEMENTWISE_STEPS: dict[str, int] = {
    "Relu": 1,
    "LeakyRelu": 1,
    "Sigmoid": 1,
    "Tanh": 1,
    "Clip": 1,
    "Add": 1,
    "Sub": 1,
    "Mul": 1,
    "Div": 1,
    "Sqrt": 1,
    "Erf": 1,
    "Pow": 1,
    "BatchNormalization": 2,
    "Softmax": 3,
    "LogSoftmax": 3,
    "HardSigmoid": 1,
    "HardSwish": 1,
}
_DATA_MOVEMENT = frozenset(
    {
        "Reshape",
        "Flatten",
        "Transpose",
        "Concat",
        "Dropout",
        "Identity",
        "Squeeze",
        "Unsqueeze",
        "Split",
        "Slice",
        "Pad",
        "Gather",
        "Shape",
        "Cast",
    }
)
_POOLS = frozenset({"MaxPool", "AveragePool"})
_GLOBAL_POOLS = frozenset({"GlobalAveragePool", "GlobalMaxPool", "ReduceMean"})
_MACS = frozenset({"Conv", "Gemm", "MatMul"})

#: every op type the IR can cost; anything else is rejected with the node named.
SUPPORTED_OPS = frozenset(
    set(_ELEMENTWISE_STEPS) | _DATA_MOVEMENT | _POOLS | _GLOBAL_POOLS | _MACS | {"Sum", "LRN"}
)

_DTYPE_BYTES = {1: 4, 2: 1, 3: 1, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 16: 2}


@dataclass(frozen=True)
class Layer:
    """One node of the model: what it computes, on which shapes, at what cost."""

    index: int
    name: str
    op_type: str
    attrs: tuple[tuple[str, Any], ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    input_shapes: tuple[Shape, ...]
    output_shapes: tuple[Shape, ...]
    params: tuple[tuple[str, Shape], ...]
    param_bytes: int
    flops: int
    mem_bytes: int
    signature: str


@dataclass
class ModelIR:
    """A model as a DAG of layers in topological order, with producer/consumer edges."""

    name: str
    batch: int
    model: onnx.ModelProto
    layers: list[Layer]
    preds: list[list[int]] = field(default_factory=list)
    succs: list[list[int]] = field(default_factory=list)

    @property
    def flops(self) -> int:
        return sum(layer.flops for layer in self.layers)

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    def by_op(self) -> dict[str, int]:
        """FLOPs per op type."""
        out: dict[str, int] = {}
        for layer in self.layers:
            out[layer.op_type] = out.get(layer.op_type, 0) + layer.flops
        return out


def _attr_value(attr: onnx.AttributeProto) -> Any:
    from onnx import helper

    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list):
        return tuple(v.decode() if isinstance(v, bytes) else v for v in value)
    if hasattr(value, "SerializeToString"):
        return hashlib.sha1(value.SerializeToString()).hexdigest()
    return value


def _numel(shape: Shape) -> int:
    return math.prod(shape)


def _flops(op: str, attrs: dict[str, Any], ins: list[Shape], outs: list[Shape]) -> int:
    out = outs[0] if outs else ()
    if op == "Conv":
        weight = ins[1]
        return _numel(out) * _numel(weight[1:])
    if op == "Gemm":
        a = ins[0]
        k = a[0] if attrs.get("transA", 0) else a[1]
        return _numel(out) * k
    if op == "MatMul":
        return _numel(out) * ins[0][-1]
    if op in _POOLS:
        return _numel(out) * _numel(tuple(attrs["kernel_shape"]))
    if op in _GLOBAL_POOLS:
        return _numel(ins[0])
    if op == "LRN":
        return _numel(out) * int(attrs["size"])
    if op == "Sum":
        return _numel(out) * max(len(ins) - 1, 1)
    if op in _ELEMENTWISE_STEPS:
        return _numel(out) * _ELEMENTWISE_STEPS[op]
    return 0


def signature(op: str, attrs: tuple[tuple[str, Any], ...], parts: list[Any]) -> str:
    """Stable hash of a layer configuration: op type, attributes, input/param/output shapes."""
    text = json.dumps([op, list(attrs), parts], sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _shapes(model: onnx.ModelProto) -> tuple[dict[str, Shape], dict[str, int]]:
    shapes: dict[str, Shape] = {}
    dtypes: dict[str, int] = {}
    graph = model.graph
    for value in [*graph.input, *graph.value_info, *graph.output]:
        tensor = value.type.tensor_type
        dims = tensor.shape.dim
        if tensor.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = tuple(int(d.dim_value) for d in dims)
            dtypes[value.name] = tensor.elem_type
    for init in graph.initializer:
        shapes[init.name] = tuple(int(d) for d in init.dims)
        dtypes[init.name] = init.data_type
    return shapes, dtypes


def build(model: onnx.ModelProto, name: str, batch: int = 1) -> ModelIR:
    """Build the IR of a model prepared by :func:`trims.evaluation.graph.prepare`."""
    from onnx import numpy_helper

    graph = model.graph
    shapes, dtypes = _shapes(model)
    inits = {t.name: t for t in graph.initializer}
    layers: list[Layer] = []
    producer: dict[str, int] = {}
    preds: list[list[int]] = []
    for index, node in enumerate(graph.node):
        label = node.name or f"{node.op_type}_{index}"
        if node.op_type not in SUPPORTED_OPS:
            raise ValidationError(
                f"model {name!r}: node {label!r} has op type {node.op_type!r}, which the "
                f"analysis does not support; supported: {', '.join(sorted(SUPPORTED_OPS))}"
            )
        attrs = tuple(sorted((a.name, _attr_value(a)) for a in node.attribute))
        acts: list[str] = []
        act_shapes: list[Shape] = []
        params: list[tuple[str, Shape]] = []
        all_in: list[Shape] = []
        parts: list[Any] = []
        param_bytes = 0
        for tensor in node.input:
            if not tensor:
                parts.append(None)
                continue
            if tensor not in shapes:
                raise ValidationError(
                    f"model {name!r}: node {label!r} ({node.op_type}) input {tensor!r} has no "
                    "known static shape; give the graph inputs fixed shapes"
                )
            shape = shapes[tensor]
            all_in.append(shape)
            if tensor in inits:
                init = inits[tensor]
                params.append((tensor, shape))
                if init.data_type == 7:
                    parts.append(["const", numpy_helper.to_array(init).tolist()])
                else:
                    parts.append(["param", list(shape), init.data_type])
                    param_bytes += _numel(shape) * _DTYPE_BYTES.get(init.data_type, 4)
            else:
                acts.append(tensor)
                act_shapes.append(shape)
                parts.append(["act", list(shape), dtypes.get(tensor, 1)])
        out_shapes: list[Shape] = []
        for tensor in node.output:
            if tensor not in shapes:
                raise ValidationError(
                    f"model {name!r}: node {label!r} ({node.op_type}) output {tensor!r} has no "
                    "inferred shape; shape inference could not resolve it"
                )
            out_shapes.append(shapes[tensor])
        parts.append(["out", [list(s) for s in out_shapes]])
        attr_map = dict(attrs)
        try:
            flops = _flops(node.op_type, attr_map, all_in, out_shapes)
        except (IndexError, KeyError) as e:
            raise ValidationError(
                f"model {name!r}: node {label!r} ({node.op_type}) has inputs or attributes the "
                f"cost model cannot read: {e!r}"
            ) from e
        act_bytes = sum(
            _numel(s) * _DTYPE_BYTES.get(dtypes.get(t, 1), 4)
            for t, s in zip(acts, act_shapes, strict=True)
        )
        out_bytes = sum(
            _numel(s) * _DTYPE_BYTES.get(dtypes.get(t, 1), 4)
            for t, s in zip(node.output, out_shapes, strict=True)
        )
        layers.append(
            Layer(
                index=index,
                name=label,
                op_type=node.op_type,
                attrs=attrs,
                inputs=tuple(acts),
                outputs=tuple(node.output),
                input_shapes=tuple(act_shapes),
                output_shapes=tuple(out_shapes),
                params=tuple(params),
                param_bytes=param_bytes,
                flops=flops,
                mem_bytes=act_bytes + param_bytes + out_bytes,
                signature=signature(node.op_type, attrs, parts),
            )
        )
        mine = sorted({producer[t] for t in acts if t in producer})
        preds.append(mine)
        for tensor in node.output:
            producer[tensor] = index
    succs: list[list[int]] = [[] for _ in layers]
    for index, mine in enumerate(preds):
        for p in mine:
            succs[p].append(index)
    return ModelIR(name=name, batch=batch, model=model, layers=layers, preds=preds, succs=succs)


def load_ir(source: str, batch: int = 1) -> ModelIR:
    """Load (zoo name, family model or path), prepare and build the IR in one step."""
    from trims.evaluation import graph

    name, model = graph.load(source)
    return model_ir(model, name, batch)


def model_ir(model: onnx.ModelProto, name: str, batch: int = 1) -> ModelIR:
    """Prepare a loaded model (see :func:`trims.evaluation.graph.prepare`) and build its IR."""
    from trims.evaluation import graph

    return build(graph.prepare(model, name, batch), name, batch)


def unique_layers(irs: list[ModelIR]) -> dict[str, list[tuple[str, Layer]]]:
    """Signature -> every (model, layer) with that configuration, across all models."""
    out: dict[str, list[tuple[str, Layer]]] = {}
    for ir in irs:
        for layer in ir.layers:
            out.setdefault(layer.signature, []).append((ir.name, layer))
    return out
