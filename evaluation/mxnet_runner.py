"""MXNet side of the MXNet backend: run graph specs with ``mx.nd`` and time them.

Runs inside the MXNet environment (mxnet 1.9.1 needs numpy < 1.24, so it lives in its own
virtualenv without onnx): ``python -m trims.evaluation.mxnet_runner SPECS.json OUT.json``.
A spec is the JSON form of an ONNX graph written by :mod:`trims.evaluation.mxnet_backend`:
inputs and weights by shape (integer constants by value), and nodes with their attributes.
The caller sets ``MXNET_ENGINE_TYPE=NaiveEngine`` so every operator runs synchronously on the
calling thread, which the thread CPU-time clock then measures.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from trims.evaluation.measure import MeasureSettings, measure

OpFn = Callable[[Any, list[Any], dict[str, Any]], list[Any]]


def _pad4(mx: Any, x: Any, pads: list[int], value: float) -> Any:
    """Explicit (possibly asymmetric) 2-D padding of an NCHW array."""
    top, left, bottom, right = pads
    return mx.nd.pad(
        x,
        mode="constant",
        constant_value=value,
        pad_width=(0, 0, 0, 0, top, bottom, left, right),
    )


def _split_pads(attrs: dict[str, Any]) -> tuple[list[int], bool]:
    pads = list(attrs.get("pads", [0, 0, 0, 0]))
    return pads, pads[:2] == pads[2:]


def _conv(mx: Any, x: list[Any], a: dict[str, Any]) -> list[Any]:
    pads, symmetric = _split_pads(a)
    data = x[0] if symmetric else _pad4(mx, x[0], pads, 0.0)
    weight = x[1]
    kwargs = {
        "kernel": tuple(a["kernel_shape"]),
        "stride": tuple(a.get("strides", [1, 1])),
        "dilate": tuple(a.get("dilations", [1, 1])),
        "pad": tuple(pads[:2]) if symmetric else (0, 0),
        "num_filter": int(weight.shape[0]),
        "num_group": int(a.get("group", 1)),
    }
    if len(x) > 2:
        return [mx.nd.Convolution(data, weight, x[2], no_bias=False, **kwargs)]
    return [mx.nd.Convolution(data, weight, no_bias=True, **kwargs)]


def _pool(kind: str) -> OpFn:
    def run(mx: Any, x: list[Any], a: dict[str, Any]) -> list[Any]:
        pads, symmetric = _split_pads(a)
        fill = float("-inf") if kind == "max" else 0.0

        def pool(t: Any) -> Any:
            return mx.nd.Pooling(
                t if symmetric else _pad4(mx, t, pads, fill),
                kernel=tuple(a["kernel_shape"]),
                pool_type=kind,
                stride=tuple(a.get("strides", [1, 1])),
                pad=tuple(pads[:2]) if symmetric else (0, 0),
                pooling_convention="full" if a.get("ceil_mode", 0) else "valid",
                count_include_pad=bool(a.get("count_include_pad", 0)),
            )

        out = pool(x[0])
        if kind == "max" or symmetric or a.get("count_include_pad", 0):
            return [out]
        # explicit asymmetric padding made the zeros count: divide by the share that is real
        return [out / pool(mx.nd.ones((1, 1, *x[0].shape[2:])))]

    return run


def _align(mx: Any, x: Any, y: Any) -> tuple[Any, Any]:
    """ONNX multidirectional broadcasting: left-pad the lower-rank operand with ones."""
    if x.ndim < y.ndim:
        x = x.reshape((1,) * (y.ndim - x.ndim) + x.shape)
    elif y.ndim < x.ndim:
        y = y.reshape((1,) * (x.ndim - y.ndim) + y.shape)
    return x, y


def _gemm(mx: Any, x: list[Any], a: dict[str, Any]) -> list[Any]:
    out = mx.nd.dot(
        x[0], x[1], transpose_a=bool(a.get("transA", 0)), transpose_b=bool(a.get("transB", 0))
    )
    out = out * float(a.get("alpha", 1.0))
    if len(x) > 2:
        lhs, rhs = _align(mx, out, x[2] * float(a.get("beta", 1.0)))
        out = mx.nd.broadcast_add(lhs, rhs)
    return [out]


def _softmax(mx: Any, x: list[Any], a: dict[str, Any]) -> list[Any]:
    axis = int(a.get("axis", 1))
    shape = x[0].shape
    flat = x[0].reshape((int(np.prod(shape[:axis])), -1))
    return [mx.nd.softmax(flat, axis=1).reshape(shape)]


def _binary(name: str) -> OpFn:
    def run(mx: Any, x: list[Any], a: dict[str, Any]) -> list[Any]:
        lhs, rhs = _align(mx, x[0], x[1])
        return [getattr(mx.nd, name)(lhs, rhs)]

    return run


def _sum(mx: Any, x: list[Any], a: dict[str, Any]) -> list[Any]:
    out = x[0]
    for t in x[1:]:
        lhs, rhs = _align(mx, out, t)
        out = mx.nd.broadcast_add(lhs, rhs)
    return [out]


OPS: dict[str, OpFn] = {
    "Conv": _conv,
    "MaxPool": _pool("max"),
    "AveragePool": _pool("avg"),
    "GlobalAveragePool": lambda mx, x, a: [
        mx.nd.Pooling(x[0], kernel=(1, 1), pool_type="avg", global_pool=True)
    ],
    "Gemm": _gemm,
    "BatchNormalization": lambda mx, x, a: [
        mx.nd.BatchNorm(
            x[0],
            x[1],
            x[2],
            x[3],
            x[4],
            eps=float(a.get("epsilon", 1e-5)),
            use_global_stats=True,
            fix_gamma=False,
        )
    ],
    "LRN": lambda mx, x, a: [
        mx.nd.LRN(
            x[0],
            alpha=float(a.get("alpha", 1e-4)),
            beta=float(a.get("beta", 0.75)),
            knorm=float(a.get("bias", 1.0)),
            nsize=int(a["size"]),
        )
    ],
    "Relu": lambda mx, x, a: [mx.nd.relu(x[0])],
    "Sigmoid": lambda mx, x, a: [mx.nd.sigmoid(x[0])],
    "Add": _binary("broadcast_add"),
    "Mul": _binary("broadcast_mul"),
    "Sum": _sum,
    "Concat": lambda mx, x, a: [mx.nd.concat(*x, dim=int(a["axis"]))],
    "Softmax": _softmax,
    "Reshape": lambda mx, x, a: [x[0].reshape(tuple(int(v) for v in x[1].asnumpy()))],
    "Flatten": lambda mx, x, a: [
        x[0].reshape((int(np.prod(x[0].shape[: int(a.get("axis", 1))])), -1))
    ],
    "Transpose": lambda mx, x, a: [mx.nd.transpose(x[0], axes=tuple(a["perm"]))],
    "Dropout": lambda mx, x, a: [x[0]],
    "Identity": lambda mx, x, a: [x[0]],
}


@dataclass(frozen=True)
class Step:
    """One ONNX node as MXNet runs it: the node's name and op type, its MXNet mapping."""

    name: str
    op_type: str
    fn: OpFn
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any]


def prepare(spec: dict[str, Any]) -> tuple[Any, dict[str, Any], list[Step]]:
    """``mxnet``, the graph's weights and inputs as arrays by name, and its steps in order."""
    import mxnet as mx

    for node in spec["nodes"]:
        if node["op"] not in OPS:
            raise ValueError(
                f"model {spec['name']!r}: node {node['name']!r} op {node['op']!r} has no MXNet "
                f"mapping; supported: {', '.join(sorted(OPS))}"
            )
    rng = np.random.default_rng(0)
    env: dict[str, Any] = {}
    for tensor in spec["params"]:
        if "values" in tensor:
            value = np.asarray(tensor["values"], dtype=tensor["dtype"]).reshape(tensor["shape"])
        else:
            value = (rng.standard_normal(tensor["shape"]) * 0.1).astype(tensor["dtype"])
        env[tensor["name"]] = mx.nd.array(value, dtype=value.dtype)
    for tensor in spec["inputs"]:
        value = tensor.get("data")
        array = (
            np.asarray(value, dtype=np.float32).reshape(tensor["shape"])
            if value is not None
            else rng.standard_normal(tensor["shape"]).astype(np.float32)
        )
        env[tensor["name"]] = mx.nd.array(array)
    steps = [
        Step(n["name"], n["op"], OPS[n["op"]], n["inputs"], n["outputs"], n["attrs"])
        for n in spec["nodes"]
    ]
    return mx, env, steps


def build(spec: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """A callable that runs the spec's graph once and returns every tensor it computed."""
    mx, env, steps = prepare(spec)
    plan = [(s.fn, s.inputs, s.outputs, s.attrs) for s in steps]

    def run() -> dict[str, Any]:
        values = dict(env)
        for fn, inputs, outputs, attrs in plan:
            results = fn(mx, [values[i] for i in inputs if i], attrs)
            for key, value in zip(outputs, results, strict=False):
                values[key] = value
        mx.nd.waitall()
        return values

    return run


def main(argv: list[str]) -> int:
    """``SPECS.json OUT.json``: measure (or, with ``"outputs_only"``, just run) every spec."""
    specs_path, out_path = argv
    with open(specs_path) as f:
        body = json.load(f)
    settings = MeasureSettings(**body["settings"])
    results: list[dict[str, Any]] = []
    for spec in body["specs"]:
        clock = settings.timer()
        start = clock()
        run = build(spec)
        if body.get("outputs_only"):
            values = run()
            results.append({o: values[o].asnumpy().tolist() for o in spec["outputs"]})
            continue
        m = measure(run, settings)
        results.append({**asdict(m), "elapsed_s": clock() - start})
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
