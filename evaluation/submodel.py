"""Cut a runnable ONNX sub-model (one layer, or a brick of layers) out of a prepared model."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import onnx

    from trims.evaluation.ir import ModelIR


#: initializers at least this large can be left out of an exported model (see :func:`weights`)
EXTERNAL_MIN_BYTES = 4096


def weights(ir: ModelIR) -> dict[str, np.ndarray]:
    """The model's large initializers as arrays, for runtimes that take weights out of band.

    A model exported with ``external=weights(ir)`` carries only these tensors' names, types and
    shapes; ONNX Runtime then uses the arrays in place
    (:func:`trims.evaluation.ort_backend.session`) instead of copying them out of the
    serialized model, so a sub-model costs no weight copy to export and far less to load.
    Small tensors (shapes, axes) stay inline: shape inference reads them.
    """
    from onnx import numpy_helper

    out: dict[str, np.ndarray] = {}
    for t in ir.model.graph.initializer:
        array = numpy_helper.to_array(t)
        if array.nbytes >= EXTERNAL_MIN_BYTES:
            out[t.name] = np.ascontiguousarray(array)
    return out


def _external(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """A data-less copy of ``tensor`` that says its data comes from elsewhere."""
    from onnx import TensorProto

    out = TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
    out.data_location = TensorProto.EXTERNAL
    entry = out.external_data.add()
    entry.key = "location"
    entry.value = "trims-out-of-band"
    return out


def extract(
    ir: ModelIR, indices: list[int], name: str, external: Collection[str] = ()
) -> onnx.ModelProto:
    """The nodes ``indices`` of ``ir`` as a standalone model.

    Graph inputs are the activations the nodes read but do not produce; graph outputs are the
    tensors they produce that another node (or the model's output) reads; only the
    initializers the nodes read are copied, and those named in ``external`` without their data.
    """
    from onnx import helper

    model = ir.model
    graph = model.graph
    chosen = set(indices)
    nodes = [graph.node[i] for i in sorted(chosen)]
    infos = {v.name: v for v in [*graph.input, *graph.value_info, *graph.output]}
    inits = {t.name: t for t in graph.initializer}
    produced = {o for n in nodes for o in n.output}
    read_outside = {i for k, n in enumerate(graph.node) if k not in chosen for i in n.input} | {
        o.name for o in graph.output
    }
    inputs: list[str] = []
    used_inits: list[str] = []
    for node in nodes:
        for tensor in node.input:
            if not tensor or tensor in produced:
                continue
            if tensor in inits:
                if tensor not in used_inits:
                    used_inits.append(tensor)
            elif tensor not in inputs:
                inputs.append(tensor)
    outputs = [o for n in nodes for o in n.output if o in read_outside]
    if not outputs:
        outputs = list(nodes[-1].output)
    sub = helper.make_graph(
        nodes,
        name,
        [infos[t] for t in inputs],
        [infos[t] for t in outputs],
        initializer=[_external(inits[t]) if t in external else inits[t] for t in used_inits],
        value_info=[infos[t] for t in produced if t in infos and t not in outputs],
    )
    out = helper.make_model(sub, opset_imports=list(model.opset_import))
    out.ir_version = model.ir_version
    return out


def group_signature(ir: ModelIR, indices: list[int]) -> str:
    """Identity of a group of layers up to weight values: layer signatures plus wiring.

    Two groups with equal signatures run the same ops on the same shapes connected the same
    way, so one benchmark serves both.
    """
    order = sorted(indices)
    position = {i: k for k, i in enumerate(order)}
    parts = []
    for i in order:
        layer = ir.layers[i]
        wiring = [position.get(p, -1) for p in ir.preds[i]]
        parts.append([layer.signature, wiring])
    return hashlib.sha1(json.dumps(parts).encode()).hexdigest()[:16]
