"""Analyses on real traces: the layer table joined to the IR, op types, compare, GPU refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trims.errors import Unavailable
from trims.evaluation.tracing import analyses
from trims.evaluation.tracing.run import make_request, trace


@pytest.fixture(scope="module")
def traced(residual_path: Path) -> dict[str, Any]:
    """torch and ORT traces of one model, each with the IR it was joined to."""
    out: dict[str, Any] = {}
    for framework in ("torch", "onnxruntime"):
        request = make_request(str(residual_path), framework=framework, runs=5, quick=True)
        result, report = trace(request)
        out[framework] = (result, report)
    return out


def _ir(residual_path: Path) -> Any:
    from trims.evaluation.tracing import workload

    return workload.load(str(residual_path), "onnxruntime").ir()


def test_ort_layer_table_flops_match_the_ir(traced: dict[str, Any], residual_path: Path) -> None:
    report = traced["onnxruntime"][1]
    body = json.loads(json.dumps(report.body))  # JSON as it is
    assert {
        "model",
        "framework",
        "levels",
        "untraced_ms",
        "coverage_pct",
        "layers",
        "trace_id",
        "unavailable",
    } <= set(body)
    ir = {layer.name: layer for layer in _ir(residual_path).layers}
    matched = [r for r in body["layers"] if r["ir_node"] is not None]
    assert body["layer_match"]["matched"] == len(matched) >= 5
    assert body["layer_match"]["method"].startswith("node name")
    for r in matched:
        nodes = r.get("fused") or [r["ir_node"]]
        assert r["gflops"] == pytest.approx(sum(ir[n].flops for n in nodes) / 1e9)
        assert r["gflop_per_s"] == pytest.approx(r["gflops"] / (r["latency_ms"] / 1e3))
    convs = [r for r in matched if r["ir_op_type"] == "Conv"]
    assert len(convs) == 5 and all(r["gflops"] > 0 for r in convs)
    assert 0 < sum(r["share_pct"] for r in body["layers"]) <= 100.0 + 1e-6
    assert "top 10 layers" in report.text and "by op type" in report.text


def test_torch_layers_match_by_order_per_op_type(
    traced: dict[str, Any], residual_path: Path
) -> None:
    _, report = traced["torch"]
    body = report.body
    assert body["layer_match"]["method"].startswith("order per op type")
    convs = [r for r in body["layers"] if r["op_type"] == "aten::conv2d"]
    ir_convs = [layer for layer in _ir(residual_path).layers if layer.op_type == "Conv"]
    assert [r["ir_node"] for r in convs] == [layer.name for layer in ir_convs]
    assert [r["gflops"] for r in convs] == pytest.approx([layer.flops / 1e9 for layer in ir_convs])


def test_op_types_top_k_and_distribution(traced: dict[str, Any]) -> None:
    body = traced["onnxruntime"][1].body
    ops = analyses.by_op_type(body["layers"])
    assert sum(o["count"] for o in ops) == len(body["layers"])
    assert sum(o["latency_ms"] for o in ops) == pytest.approx(
        sum(r["latency_ms"] for r in body["layers"])
    )
    top = analyses.top_k(body["layers"], 3)
    assert len(top) == 3 and top[0]["latency_ms"] == max(r["latency_ms"] for r in body["layers"])
    dist = analyses.layer_type_distribution([traced[f][1].body for f in traced], "Conv")
    assert {d["framework"] for d in dist} == {"torch", "onnxruntime"}
    assert all(d["min_ms"] <= d["median_ms"] <= d["max_ms"] for d in dist)


def test_compare_torch_with_onnxruntime(traced: dict[str, Any]) -> None:
    a, b = traced["torch"][1].body, traced["onnxruntime"][1].body
    c = analyses.compare(a, b)
    assert (c["a"]["framework"], c["b"]["framework"]) == ("torch", "onnxruntime")
    assert "Conv" in {o["op_type"] for o in c["op_types"]}
    conv = next(o for o in c["op_types"] if o["op_type"] == "Conv")
    assert conv["a_ms"] > 0 and conv["b_ms"] > 0
    assert c["matched_layers"] >= 1
    assert all(row["a_ms"] > 0 and row["b_ms"] > 0 for row in c["layers"])
    assert "layers matched" in analyses.compare_text(c)


def test_gpu_analyses_are_refused_without_kernels(traced: dict[str, Any]) -> None:
    result, report = traced["torch"]
    with pytest.raises(Unavailable, match="GPU analyses need kernel spans"):
        analyses.kernels_per_layer(result.trace, report.body["unavailable"])
    with pytest.raises(Unavailable, match="kernel spans"):
        analyses.kernel_share(result.trace)
    with pytest.raises(Unavailable, match="kernel spans"):
        analyses.roofline(result.trace, report.body["layers"])


def test_plot_is_drawn(traced: dict[str, Any], tmp_path: Path) -> None:
    (path,) = traced["onnxruntime"][1].plot(tmp_path)
    assert path.stat().st_size > 0
