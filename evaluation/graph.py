"""Prepare an ONNX model for analysis: load it, fold constants, set the batch, infer shapes.

Every analysis (IR, micro-benchmarks, bricks, end-to-end measurement) works on the *prepared*
model, so a layer benchmarked on its own is the same node the whole model runs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trims.errors import CorruptModel, ValidationError

if TYPE_CHECKING:
    import onnx

log = logging.getLogger(__name__)


def load(source: str) -> tuple[str, onnx.ModelProto]:
    """Load a model and return ``(name, model)``.

    ``source`` is a zoo name (``resnet50``), a PyTorch family model (``torch:resnet101``,
    exported on the fly) or the path of an ONNX file.
    """
    import onnx

    from trims.evaluation import families, zoo

    if source in zoo.zoo_names():
        return source, zoo.materialize(source)
    if families.is_family(source):
        return source, families.export(source)
    path = Path(source)
    if not path.is_file():
        raise CorruptModel(
            f"model {source!r} is neither a zoo model ({', '.join(zoo.zoo_names())}), "
            f"a PyTorch family model ({', '.join(families.FAMILIES)}) nor a file"
        )
    try:
        model = onnx.load(str(path))
    except Exception as e:
        raise CorruptModel(f"model {path.stem!r} ({path}) is not a valid ONNX file: {e}") from e
    return path.stem, zoo.materialize_constants(model, path.stem)


def fold_constants(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """Evaluate nodes whose inputs are all constants and store their outputs as initializers.

    ``Constant`` nodes become initializers; parameter-only chains (the ``Unsqueeze`` of
    batch-norm scales in DenseNet and Inception v2) are computed once here, as ONNX Runtime does
    at session start, so they never count as layers.
    """
    import onnx
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    graph = model.graph
    consts: dict[str, np.ndarray] = {}
    for tensor in graph.initializer:
        try:
            consts[tensor.name] = numpy_helper.to_array(tensor)
        except Exception as e:
            raise CorruptModel(
                f"model {name!r}: initializer {tensor.name!r} (dims {list(tensor.dims)}) does "
                f"not hold the data its shape promises: {e}"
            ) from e
    keep: list[onnx.NodeProto] = []
    folded = 0
    for node in graph.node:
        inputs = [i for i in node.input if i]
        if node.op_type == "Constant" or (inputs and all(i in consts for i in inputs)):
            single = onnx.helper.make_graph(
                [node],
                "fold",
                [
                    onnx.helper.make_tensor_value_info(i, onnx.TensorProto.UNDEFINED, None)
                    for i in inputs
                ],
                [
                    onnx.helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None)
                    for o in node.output
                ],
            )
            sub = onnx.helper.make_model(single, opset_imports=model.opset_import)
            try:
                results = ReferenceEvaluator(sub).run(None, {i: consts[i] for i in inputs})
            except Exception as e:
                raise ValidationError(
                    f"model {name!r}: constant node {node.name or node.output[0]!r} "
                    f"({node.op_type}) cannot be evaluated: {e}"
                ) from e
            for out, value in zip(node.output, results, strict=True):
                consts[out] = np.asarray(value)
            folded += 1
            continue
        keep.append(node)
    if folded:
        used = {i for n in keep for i in n.input} | {o.name for o in graph.output}
        del graph.node[:]
        graph.node.extend(keep)
        del graph.initializer[:]
        graph.initializer.extend(
            numpy_helper.from_array(v, k) for k, v in consts.items() if k in used
        )
        log.debug("model %s: %d constant nodes folded into initializers", name, folded)
    return model


def drop_unused_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Remove trailing optional outputs nothing reads (Dropout's mask in opset 9 models)."""
    graph = model.graph
    read = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    for node in graph.node:
        while len(node.output) > 1 and node.output[-1] not in read:
            del node.output[-1]
    return model


def set_batch(model: onnx.ModelProto, batch: int) -> onnx.ModelProto:
    """Give every graph input batch size ``batch`` (dimension 0).

    Exporters hard-code the batch in Reshape targets (``[1, 9216]``); a constant Reshape target
    applied to an activation whose leading entry is 1 is rewritten to ``batch`` as well.
    """
    from onnx import numpy_helper

    if batch < 1:
        raise ValidationError(f"batch size must be >= 1, got {batch}")
    graph = model.graph
    for value in graph.input:
        dims = value.type.tensor_type.shape.dim
        if dims:
            dims[0].ClearField("dim_param")
            dims[0].dim_value = batch
    for value in graph.output:
        dims = value.type.tensor_type.shape.dim
        if dims:
            dims[0].ClearField("dim_value")
            dims[0].dim_param = "batch"
    del graph.value_info[:]
    if batch == 1:
        return model
    inits = {t.name: i for i, t in enumerate(graph.initializer)}
    for node in graph.node:
        if node.op_type != "Reshape" or node.input[1] not in inits:
            continue
        if node.input[0] in inits:
            continue
        index = inits[node.input[1]]
        target = numpy_helper.to_array(graph.initializer[index]).copy()
        if target.size and target[0] == 1:
            target[0] = batch
            graph.initializer[index].CopyFrom(numpy_helper.from_array(target, node.input[1]))
    return model


def _skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model without float weight data: big initializers become typed graph inputs.

    Shape inference and the checker serialize the whole model; on VGG-19 (548 MB) that costs
    seconds. Integer initializers (Reshape targets) stay, so data propagation still sees them.
    """
    import onnx

    src = model.graph
    stubs = [
        onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in src.initializer
        if t.data_type != onnx.TensorProto.INT64
    ]
    graph = onnx.helper.make_graph(
        list(src.node),
        src.name,
        [*src.input, *stubs],
        list(src.output),
        initializer=[t for t in src.initializer if t.data_type == onnx.TensorProto.INT64],
    )
    skeleton = onnx.helper.make_model(graph, opset_imports=list(model.opset_import))
    skeleton.ir_version = model.ir_version
    return skeleton


def infer_shapes(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """Run ONNX shape inference (strict, data propagation) and the checker on the skeleton.

    The inferred value_info is copied back into ``model``, which keeps its weights.
    """
    import onnx

    skeleton = _skeleton(model)
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton, strict_mode=True, data_prop=True)
    except Exception as e:
        raise ValidationError(f"model {name!r}: shape inference failed: {e}") from e
    try:
        onnx.checker.check_model(inferred)
    except Exception as e:
        raise CorruptModel(f"model {name!r} fails the ONNX checker: {e}") from e
    del model.graph.value_info[:]
    model.graph.value_info.extend(inferred.graph.value_info)
    del model.graph.output[:]
    model.graph.output.extend(inferred.graph.output)
    return model


def prepare(model: onnx.ModelProto, name: str, batch: int = 1) -> onnx.ModelProto:
    """Fold constants, set the batch and infer shapes: the model every analysis uses."""
    if model.ir_version < 4:
        model.ir_version = 4
    model = fold_constants(model, name)
    model = drop_unused_outputs(model)
    model = set_batch(model, batch)
    return infer_shapes(model, name)
