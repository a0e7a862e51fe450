"""Analyses over traces: model latency per level, the layer table, op types, top-k, compare.

The layer table reads the top-level layer spans of a trace (operators the model called itself,
not the ones those called) and joins them to the layer IR (:mod:`trims.evaluation.ir`) for
FLOPs and bytes:

* ONNX Runtime names its node events after the graph's nodes: a span matches the IR node of the
  same name; a node ORT fused or moved into the NCHWc layout is named after the tensor it
  produces (``/2/Relu_output_0_nchwc``), so it matches the IR node producing that tensor, and
  back along the fused chain to the node of ORT's op type (``Conv`` for a fused Conv+Relu; the
  row's FLOPs are the whole chain's).
* MXNet layer spans are ONNX nodes (the MXNet workload groups each node's operators under a span
  named after the node, Note [MXNet operators per ONNX node] in mxnet_child.py): they match the
  IR node of the same name, as ONNX Runtime's do.
* PyTorch operators carry no graph names: the k-th operator of an ONNX op type (``aten::conv2d``
  is ``Conv``) matches the k-th IR node of that type, in order. Operators the exporter folds away
  (``aten::batch_norm`` into the convolution) stay unmatched.

Each table says which method it used and how many layers matched. ``gflops`` in a row is the
layer's work (GFLOP, multiply-adds as the IR counts them) and ``gflop_per_s`` the rate achieved.

Trace summaries (the JSON of ``trims trace``, :func:`summary`) are what comparisons and
cross-model distributions read, so a stored trace can be compared without its spans. The GPU
analyses (kernels per layer, kernel time share, roofline) need kernel spans; on a trace without
them they raise :class:`~trims.errors.Unavailable` with the reason the kernel level gave.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trims.errors import Unavailable, ValidationError
from trims.evaluation.analyses import Report, table
from trims.evaluation.tracing.leveled import LeveledResult, top_level
from trims.tracing.levels import Level
from trims.tracing.spans import Span, Trace

if TYPE_CHECKING:
    from trims.evaluation.ir import Layer, ModelIR

__all__ = [
    "LayerMatch",
    "by_op_type",
    "compare",
    "kernel_share",
    "kernels_per_layer",
    "layer_rows",
    "layer_type_distribution",
    "level_rows",
    "report",
    "roofline",
    "summary",
    "top_k",
]

#: torch operators -> the ONNX op type they export to
TORCH_TO_ONNX = {
    "aten::conv2d": "Conv",
    "aten::linear": "Gemm",
    "aten::addmm": "Gemm",
    "aten::matmul": "MatMul",
    "aten::relu": "Relu",
    "aten::relu_": "Relu",
    "aten::add": "Add",
    "aten::add_": "Add",
    "aten::mul": "Mul",
    "aten::max_pool2d": "MaxPool",
    "aten::avg_pool2d": "AveragePool",
    "aten::adaptive_avg_pool2d": "GlobalAveragePool",
    "aten::mean": "GlobalAveragePool",
    "aten::flatten": "Flatten",
    "aten::reshape": "Reshape",
    "aten::view": "Reshape",
    "aten::cat": "Concat",
    "aten::softmax": "Softmax",
    "aten::sigmoid": "Sigmoid",
    "aten::tanh": "Tanh",
    "aten::dropout": "Dropout",
    "aten::batch_norm": "BatchNormalization",
    "aten::local_response_norm": "LRN",
}
_ORT_SUFFIXES = ("_nchwc", "_token")
#: frameworks whose layer spans carry ONNX node names -> how the layer table matches them
_BY_NODE_NAME = {
    "onnxruntime": "node name (ONNX Runtime node events -> ONNX graph nodes)",
    "mxnet": "node name (MXNet operators grouped by the ONNX node that issued them)",
}


@dataclass(frozen=True)
class LayerMatch:
    """How the layer spans were joined to the IR."""

    method: str
    matched: int
    layers: int
    ir_nodes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "matched": self.matched,
            "layers": self.layers,
            "ir_nodes": self.ir_nodes,
        }


def _shape(span: Span) -> str:
    shapes = span.attributes.get("input_shapes")
    if isinstance(shapes, list):
        return " ".join(str(s) for s in shapes)
    return ""


def _op(span: Span) -> str:
    return str(span.attributes.get("op_type", span.name))


def _ort_match(
    span: Span, ir: ModelIR, by_name: Mapping[str, Layer], producers: Mapping[str, Layer]
) -> list[Layer]:
    """The IR nodes an ONNX Runtime node event ran (module docstring): [] when none."""
    name = str(span.attributes.get("name", span.name))
    if name in by_name:
        return [by_name[name]]
    tensor = name
    for suffix in _ORT_SUFFIXES:
        if suffix in tensor:
            tensor = tensor[: tensor.index(suffix)]
    last = producers.get(tensor) or by_name.get(tensor)
    if last is None:
        return []
    chain, node = [last], last
    want = _op(span)
    for _ in range(4):
        if node.op_type == want:
            return chain
        preds = [ir.layers[i] for i in ir.preds[node.index]]
        if not preds:
            break
        node = next((p for p in preds if p.op_type == want), preds[0])
        chain.insert(0, node)
    return [last]


def layer_rows(
    spans: Sequence[Span], framework: str, ir: ModelIR | None, predict_ns: int | None
) -> tuple[list[dict[str, Any]], LayerMatch]:
    """The layer table of one run's spans (see the module docstring)."""
    layers = sorted(top_level(spans), key=lambda s: s.start_ns)
    denominator = predict_ns or sum(s.duration_ns for s in layers) or 1
    matches: list[list[Layer]] = [[] for _ in layers]
    method = "none (no layer IR)"
    if ir is not None and framework in _BY_NODE_NAME:
        method = _BY_NODE_NAME[framework]
        by_name = {layer.name: layer for layer in ir.layers}
        producers = {t: layer for layer in ir.layers for t in layer.outputs}
        matches = [_ort_match(s, ir, by_name, producers) for s in layers]
    elif ir is not None:
        method = "order per op type (k-th torch operator of an ONNX type -> k-th IR node of it)"
        queues: dict[str, list[Layer]] = defaultdict(list)
        for layer in ir.layers:
            queues[layer.op_type].append(layer)
        taken: dict[str, int] = defaultdict(int)
        for i, s in enumerate(layers):
            onnx_op = TORCH_TO_ONNX.get(_op(s))
            if onnx_op is None or taken[onnx_op] >= len(queues[onnx_op]):
                continue
            matches[i] = [queues[onnx_op][taken[onnx_op]]]
            taken[onnx_op] += 1
    ordinal: dict[str, int] = defaultdict(int)
    rows: list[dict[str, Any]] = []
    for s, match in zip(layers, matches, strict=True):
        op = _op(s)
        name = (
            str(s.attributes.get("name", s.name))
            if framework in _BY_NODE_NAME
            else f"{op}_{ordinal[op]}"
        )
        ordinal[op] += 1
        flops = sum(layer.flops for layer in match)
        seconds = s.duration_ns / 1e9
        row: dict[str, Any] = {
            "name": name,
            "op_type": op,
            "shape": _shape(s),
            "latency_ms": s.duration_ns / 1e6,
            "share_pct": 100.0 * s.duration_ns / denominator,
            "gflops": flops / 1e9 if match else None,
            "gflop_per_s": flops / 1e9 / seconds if match and seconds > 0 else None,
            "mem_bytes": sum(layer.mem_bytes for layer in match) if match else None,
            "ir_node": match[-1].name if match else None,
            "ir_op_type": match[-1].op_type if match else None,
        }
        if len(match) > 1:
            row["fused"] = [layer.name for layer in match]
            row["ir_node"] = next((m.name for m in match if m.op_type == op), match[-1].name)
            row["ir_op_type"] = next(
                (m.op_type for m in match if m.op_type == op), match[-1].op_type
            )
        rows.append(row)
    info = LayerMatch(
        method, sum(1 for m in matches if m), len(layers), len(ir.layers) if ir else 0
    )
    return rows, info


def by_op_type(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Layer rows summed per op type, slowest first."""
    acc: dict[str, dict[str, Any]] = {}
    for r in rows:
        a = acc.setdefault(
            r["op_type"],
            {
                "op_type": r["op_type"],
                "count": 0,
                "latency_ms": 0.0,
                "share_pct": 0.0,
                "gflops": 0.0,
            },
        )
        a["count"] += 1
        a["latency_ms"] += r["latency_ms"]
        a["share_pct"] += r["share_pct"]
        a["gflops"] += r.get("gflops") or 0.0
    return sorted(acc.values(), key=lambda a: -a["latency_ms"])


def top_k(rows: Iterable[Mapping[str, Any]], k: int = 10) -> list[Mapping[str, Any]]:
    """The ``k`` slowest layers."""
    return sorted(rows, key=lambda r: -r["latency_ms"])[:k]


def level_rows(result: LeveledResult) -> list[dict[str, Any]]:
    """Model latency per level: the JSON ``levels`` list."""
    return [
        {
            "level": r.level.label,
            "latency_ms": r.latency_ms,
            "overhead_pct": r.overhead_pct,
            "runs": r.measurement.reps,
            "median_ms": r.measurement.median_ms,
            "spread_ms": r.measurement.spread_ms,
        }
        for r in result.levels
    ]


def _layer_run(trace: Trace) -> list[Span]:
    return [s for s in trace.spans if s.level is Level.LAYER]


def summary(result: LeveledResult, ir: ModelIR | None) -> dict[str, Any]:
    """The trace's JSON: the keys docs/evaluation.md documents, and the match, op types and
    errors besides."""
    rows, match = layer_rows(
        _layer_run(result.trace), result.framework, ir, result.layer_predict_ns
    )
    return {
        "model": result.model,
        "framework": result.framework,
        "batch": result.batch,
        "levels": level_rows(result),
        "untraced_ms": result.untraced.trimmed_mean_ms,
        "untraced_runs": result.untraced.reps,
        "coverage_pct": result.coverage_pct,
        "layers": rows,
        "layer_match": match.to_dict(),
        "op_types": by_op_type(rows),
        "trace_id": result.trace.trace_id,
        "unavailable": {level.label: why for level, why in result.unavailable.items()},
        "errors": {level.label: why for level, why in result.errors.items()},
        "spans": len(result.trace.spans),
    }


def _f(value: Any) -> Any:
    return "-" if value is None else value


def text(body: Mapping[str, Any], k: int = 10) -> str:
    """The human tables of a trace summary."""
    batch = body.get("batch", 1)
    head = f"{body['model']} ({body['framework']}, batch {batch}), trace {body['trace_id']}"
    parts = [head, "", f"untraced: {body['untraced_ms']:.3f} ms"]
    parts.append(
        table(
            ["level", "latency ms", "overhead %", "runs"],
            [
                [lv["level"], lv["latency_ms"], lv["overhead_pct"], lv["runs"]]
                for lv in body["levels"]
            ],
        )
    )
    if body.get("coverage_pct") is not None:
        parts.append(f"layer coverage of model time: {body['coverage_pct']:.1f}%")
    match = body.get("layer_match") or {}
    if body.get("layers"):
        parts += [
            "",
            f"top {k} layers (matched to the IR by {match.get('method')}: "
            f"{match.get('matched')} of {match.get('layers')} layers, "
            f"{match.get('ir_nodes')} IR nodes)",
            table(
                ["name", "op type", "ms", "share %", "GFLOP", "GFLOP/s"],
                [
                    [
                        r["name"],
                        r["op_type"],
                        r["latency_ms"],
                        r["share_pct"],
                        _f(r["gflops"]),
                        _f(r["gflop_per_s"]),
                    ]
                    for r in top_k(body["layers"], k)
                ],
            ),
            "",
            "by op type",
            table(
                ["op type", "count", "ms", "share %", "GFLOP"],
                [
                    [o["op_type"], o["count"], o["latency_ms"], o["share_pct"], o["gflops"]]
                    for o in body.get("op_types") or by_op_type(body["layers"])
                ],
            ),
        ]
    for level, why in (body.get("unavailable") or {}).items():
        parts.append(f"level {level} unavailable: {why}")
    for level, why in (body.get("errors") or {}).items():
        parts.append(f"level {level} profiler failed: {why}")
    return "\n".join(parts)


def report(result: LeveledResult, ir: ModelIR | None) -> Report:
    """The leveled run as a :class:`Report`: the summary JSON, its tables, an op-type plot."""
    body = summary(result, ir)

    def draw(folder: Path) -> list[Path]:
        return [op_type_plot(body, folder / f"trace-{body['trace_id'][:8]}-op-types.png")]

    return Report(body=body, text=text(body), plot=draw)


def op_type_plot(body: Mapping[str, Any], path: Path) -> Path:
    """Horizontal bars: layer time per op type."""
    from trims.evaluation.plots import _pyplot

    plt = _pyplot()
    ops = (body.get("op_types") or by_op_type(body["layers"]))[:15]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.barh([o["op_type"] for o in ops][::-1], [o["latency_ms"] for o in ops][::-1])
    ax.set_xlabel("layer time (ms)")
    ax.set_title(f"{body['model']} ({body['framework']}): layer time by op type")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _op_key(row: Mapping[str, Any]) -> str:
    return str(row.get("ir_op_type") or row["op_type"])


def compare(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Two trace summaries side by side: model latency, per op type, per matched layer.

    Op types compare by the IR op type where a layer matched (so ``aten::conv2d`` and ONNX
    Runtime's ``Conv`` meet as ``Conv``); layers compare by their IR node, or by name when
    neither matched the IR (two traces of one framework).
    """
    for which, body in (("first", a), ("second", b)):
        if not isinstance(body, Mapping) or "layers" not in body or "untraced_ms" not in body:
            raise ValidationError(
                f"the {which} trace is not a trace summary (no layers/untraced_ms)"
            )

    def ratio(x: float, y: float) -> float | None:
        return y / x if x else None

    ops_a: dict[str, float] = defaultdict(float)
    ops_b: dict[str, float] = defaultdict(float)
    for rows, acc in ((a["layers"], ops_a), (b["layers"], ops_b)):
        for r in rows:
            acc[_op_key(r)] += r["latency_ms"]
    op_rows = [
        {
            "op_type": op,
            "a_ms": ops_a.get(op, 0.0),
            "b_ms": ops_b.get(op, 0.0),
            "ratio": ratio(ops_a.get(op, 0.0), ops_b.get(op, 0.0)),
        }
        for op in sorted(
            set(ops_a) | set(ops_b), key=lambda o: -(ops_a.get(o, 0) + ops_b.get(o, 0))
        )
    ]

    def keyed(rows: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
        return {str(r.get("ir_node") or r["name"]): r for r in rows}

    la, lb = keyed(a["layers"]), keyed(b["layers"])
    layer_rows_ = [
        {
            "layer": key,
            "op_type": _op_key(la[key]),
            "a_ms": la[key]["latency_ms"],
            "b_ms": lb[key]["latency_ms"],
            "ratio": ratio(la[key]["latency_ms"], lb[key]["latency_ms"]),
        }
        for key in la
        if key in lb
    ]

    def side(body: Mapping[str, Any]) -> dict[str, Any]:
        model_ms = next((lv["latency_ms"] for lv in body["levels"] if lv["level"] == "model"), None)
        return {
            "model": body["model"],
            "framework": body["framework"],
            "batch": body.get("batch"),
            "trace_id": body.get("trace_id"),
            "untraced_ms": body["untraced_ms"],
            "model_ms": model_ms,
        }

    return {
        "a": side(a),
        "b": side(b),
        "untraced_ratio": ratio(a["untraced_ms"], b["untraced_ms"]),
        "op_types": op_rows,
        "layers": layer_rows_,
        "matched_layers": len(layer_rows_),
    }


def compare_text(c: Mapping[str, Any]) -> str:
    a, b = c["a"], c["b"]
    head = (
        f"compare a={a['model']} ({a['framework']}, batch {a['batch']}) "
        f"vs b={b['model']} ({b['framework']}, batch {b['batch']}): "
        f"untraced {a['untraced_ms']:.3f} ms vs {b['untraced_ms']:.3f} ms"
    )
    return "\n".join(
        [
            head,
            table(
                ["op type", "a ms", "b ms", "b/a"],
                [[o["op_type"], o["a_ms"], o["b_ms"], _f(o["ratio"])] for o in c["op_types"]],
            ),
            f"{c['matched_layers']} layers matched",
        ]
    )


def layer_type_distribution(
    summaries: Iterable[Mapping[str, Any]], op_type: str
) -> list[dict[str, Any]]:
    """Latency of one layer type (framework or IR op type) per trace: count, min, median, max."""
    out = []
    for body in summaries:
        times = [
            r["latency_ms"]
            for r in body["layers"]
            if op_type in (r["op_type"], r.get("ir_op_type"))
        ]
        if not times:
            continue
        out.append(
            {
                "model": body["model"],
                "framework": body["framework"],
                "count": len(times),
                "min_ms": min(times),
                "median_ms": statistics.median(times),
                "max_ms": max(times),
                "total_ms": sum(times),
            }
        )
    return out


def _kernels(trace: Trace, unavailable: Mapping[str, str] | None) -> list[Span]:
    kernels = [
        s for s in trace.spans if s.level is Level.KERNEL and s.attributes.get("kind") != "launch"
    ]
    if not kernels:
        why = (unavailable or {}).get(
            "kernel"
        ) or "the trace has no kernel spans (traced below kernel level?)"
        raise Unavailable(f"GPU analyses need kernel spans: {why}")
    return kernels


def _layer_of(span: Span, by_id: Mapping[str, Span]) -> Span | None:
    node = span
    seen = 0
    while node.parent_id is not None and seen < 64:
        parent = by_id.get(node.parent_id)
        if parent is None:
            return None
        if parent.level is Level.LAYER and (
            parent.parent_id is None or by_id.get(parent.parent_id, parent).level is not Level.LAYER
        ):
            return parent
        node, seen = parent, seen + 1
    return None


def kernels_per_layer(
    trace: Trace, unavailable: Mapping[str, str] | None = None
) -> list[dict[str, Any]]:
    """Per top-level layer: kernels launched and their GPU time (launch -> kernel correlation)."""
    kernels = _kernels(trace, unavailable)
    by_id = {s.span_id: s for s in trace.spans}
    acc: dict[str, dict[str, Any]] = {}
    for k in kernels:
        layer = _layer_of(k, by_id)
        key = layer.span_id if layer else "(no layer)"
        row = acc.setdefault(
            key, {"layer": _op(layer) if layer else "(no layer)", "kernels": 0, "kernel_ms": 0.0}
        )
        row["kernels"] += 1
        row["kernel_ms"] += k.duration_ns / 1e6
    return sorted(acc.values(), key=lambda r: -r["kernel_ms"])


def kernel_share(trace: Trace, unavailable: Mapping[str, str] | None = None) -> float:
    """Percent of the model span's time the GPU spent in kernels (union of kernel intervals)."""
    from trims.evaluation.tracing.leveled import coverage_pct

    kernels = _kernels(trace, unavailable)
    model = next(s for s in trace.spans if s.level is Level.MODEL and s.name.startswith("predict"))
    window = Span(
        "window",
        Level.MODEL,
        min(model.start_ns, *(k.start_ns for k in kernels)),
        max(model.end_ns, *(k.end_ns for k in kernels)),
        model.track,
    )
    return coverage_pct(kernels, window)


def roofline(
    trace: Trace, rows: Sequence[Mapping[str, Any]], unavailable: Mapping[str, str] | None = None
) -> list[dict[str, Any]]:
    """Per matched layer: arithmetic intensity (FLOP/byte, IR) and GFLOP/s over its kernel time."""
    per_layer = {r["layer"]: r for r in kernels_per_layer(trace, unavailable)}
    out = []
    for r in rows:
        if not r.get("gflops") or not r.get("mem_bytes"):
            continue
        k = per_layer.get(r["op_type"])
        seconds = (k["kernel_ms"] / 1e3) if k else r["latency_ms"] / 1e3
        out.append(
            {
                "name": r["name"],
                "intensity_flop_per_byte": r["gflops"] * 1e9 / r["mem_bytes"],
                "gflop_per_s": r["gflops"] / seconds if seconds else None,
            }
        )
    return out
