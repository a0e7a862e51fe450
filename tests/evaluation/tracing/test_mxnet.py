"""Leveled MXNet traces from the main environment: the model runs in the MXNet virtualenv.

Skips (with the reason) where no MXNet environment is found: ``$TRIMS_MXNET_PYTHON``,
``$TRIMS_MXNET_VENV`` or /tmp/trims-mxnet-venv, which CI creates.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from trims.errors import Unavailable, ValidationError
from trims.evaluation import mxnet_backend
from trims.evaluation.measure import MeasureSettings
from trims.evaluation.tracing import analyses, workload
from trims.evaluation.tracing.leveled import TraceSettings, measure_levels, top_level
from trims.evaluation.tracing.mxnet_child import group_by_node
from trims.evaluation.tracing.mxnet_workload import find_python
from trims.tracing.levels import Level
from trims.tracing.spans import Span

FAST = MeasureSettings(warmup=1, min_reps=3, max_reps=5, max_time_s=0.5, clock="wall")


@pytest.fixture(scope="module")
def mx_python() -> str:
    python = find_python()
    if not Path(python).is_file():
        pytest.skip(f"no MXNet environment at {python}: set TRIMS_MXNET_PYTHON")
    try:
        mxnet_backend.framework_version(python)
    except Unavailable as e:
        pytest.skip(f"no MXNet environment: {e.message}")
    return python


def test_layer_trace_through_the_mxnet_environment(mx_python: str, residual_path: Path) -> None:
    w = workload.load(str(residual_path), "mxnet", mxnet_python=mx_python)
    try:
        result = measure_levels(w, TraceSettings(level=Level.FULL, measure=FAST))
        ir = w.ir()
    finally:
        w.close()
    assert result.framework == "mxnet"
    assert [r.level for r in result.levels] == [Level.MODEL, Level.LAYER]
    assert set(result.unavailable) == {Level.LIBRARY, Level.KERNEL} and not result.errors
    for r in result.levels:
        assert 3 <= r.measurement.reps <= 5
        expected = 100.0 * (r.latency_ms / result.untraced.trimmed_mean_ms - 1.0)
        assert r.overhead_pct == pytest.approx(expected)
    assert result.coverage_pct is not None and 0 < result.coverage_pct <= 100
    # one predict at the root; each ONNX node a layer span under it, its operators below that
    roots = [s for d, s in result.trace.walk() if d == 0]
    assert [s.name for s in roots] == ["predict residual"]
    (predict,) = roots
    nodes = top_level(result.trace.spans)
    assert {s.parent_id for s in nodes} == {predict.span_id}
    assert [s.attributes["op_type"] for s in nodes if s.attributes["op_type"] == "Conv"] == [
        "Conv"
    ] * 5
    ir_names = {layer.name for layer in ir.layers}
    assert {s.name for s in nodes} <= ir_names
    by_id = {s.span_id: s for s in nodes}
    operators = [s for s in result.trace.by_level(Level.LAYER) if s.span_id not in by_id]
    assert operators and all(
        by_id[s.parent_id].name == s.attributes["onnx_node"] for s in operators if s.parent_id
    )
    assert {s.attributes["op_type"] for s in operators} >= {"Convolution", "relu"}
    rows, match = analyses.layer_rows(
        result.trace.by_level(Level.LAYER), "mxnet", ir, result.layer_predict_ns
    )
    assert match.method.startswith("node name") and match.matched == match.layers == len(nodes)
    conv = next(r for r in rows if r["ir_node"] == "b0_conv_a")
    assert conv["name"] == "b0_conv_a" and conv["gflops"] > 0


def test_operators_are_grouped_by_the_node_that_issued_them() -> None:
    track = ("p", "t")
    ops = [  # as the MXNet source makes them
        Span(op, Level.LAYER, start, end, track, attributes={"op_type": op, "depth": 0})
        for op, start, end in (("dot", 10, 20), ("_mul_scalar", 21, 24), ("relu", 31, 35))
    ]
    ops.append(Span("stray", Level.LAYER, 50, 52, track, attributes={"op_type": "x", "depth": 0}))
    out = group_by_node(ops, [("fc", "Gemm", 9, 25), ("act", "Relu", 30, 36)])
    nodes = {s.name: s for s in out if s.attributes.get("depth") == 0 and s.parent_id is None}
    assert set(nodes) == {"fc", "act", "stray"}
    assert (nodes["fc"].start_ns, nodes["fc"].end_ns) == (10, 24)
    assert nodes["fc"].attributes["mxnet_ops"] == ["dot", "_mul_scalar"]
    assert nodes["fc"].attributes["op_type"] == "Gemm"
    children = [s for s in out if s.parent_id == nodes["fc"].span_id]
    assert [s.name for s in children] == ["dot", "_mul_scalar"]
    assert all(s.attributes["onnx_node"] == "fc" and s.attributes["depth"] == 1 for s in children)


def test_cli_traces_squeezenet_with_mxnet(mx_python: str, tmp_path: Path) -> None:
    out, chrome, db = tmp_path / "t.json", tmp_path / "t.trace.json", tmp_path / "r.sqlite"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trims.cli",
            "trace",
            "squeezenet",
            "--framework",
            "mxnet",
            "--level",
            "layer",
            "--quick",
            "--json",
            str(out),
            "--chrome",
            str(chrome),
            "--db",
            str(db),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "TRIMS_MXNET_PYTHON": mx_python},
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    body = json.loads(out.read_text())
    assert body["model"] == "squeezenet" and body["framework"] == "mxnet"
    assert [lv["level"] for lv in body["levels"]] == ["model", "layer"]
    assert 0 < body["coverage_pct"] <= 100
    assert body["layer_match"]["matched"] == body["layer_match"]["layers"] > 20
    assert {r["op_type"] for r in body["layers"]} >= {"Conv", "Relu", "Concat"}
    events = json.loads(chrome.read_text())["traceEvents"]
    assert any(e.get("name") == "predict squeezenet" for e in events)
    assert any(e.get("name") == "Convolution" for e in events)
    assert f"stored trace {body['trace_id']}" in done.stdout


def test_trace_function_runs_mxnet_with_the_configured_python(
    mx_python: str, residual_path: Path, tmp_path: Path
) -> None:
    runtime_functions = pytest.importorskip("trims.runtime.functions")
    from trims.evaluation.tracing import function

    def ctx(python: str) -> object:
        return runtime_functions.Context(
            function="trace",
            instance_id="test",
            models={},
            logger=logging.getLogger("test"),
            tracer=None,
            config={"db": str(tmp_path / "r.sqlite"), "mxnet_python": python},
        )

    body = {"model": "squeezenet", "framework": "mxnet", "level": "layer", "quick": True}
    request = runtime_functions.Request(
        json.dumps(body).encode(), {"content-type": "application/json"}
    )
    answer = function.handler(request, ctx(mx_python))
    assert answer["framework"] == "mxnet" and answer["coverage_pct"] > 0
    assert answer["chrome"]["traceEvents"]
    with pytest.raises(Unavailable, match="TRIMS_MXNET_PYTHON"):
        function.handler(request, ctx(str(tmp_path / "no-venv" / "python")))


def test_missing_environment_is_unavailable_naming_it(
    residual_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    monkeypatch.setenv("TRIMS_MXNET_PYTHON", missing)
    with pytest.raises(Unavailable, match=r"TRIMS_MXNET_PYTHON") as info:
        workload.load(str(residual_path), "mxnet")
    assert missing in info.value.message


def test_a_graph_mxnet_cannot_run_is_refused(mx_python: str, tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Tanh", ["x"], ["y"], name="squash")],
        "tanh",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = tmp_path / "tanh.onnx"
    onnx.save(model, str(path))
    with pytest.raises(ValidationError, match=r"does not run in MXNet.*Tanh"):
        workload.load(str(path), "mxnet", mxnet_python=mx_python)
