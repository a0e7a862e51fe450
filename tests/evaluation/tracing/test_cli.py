"""``trims trace`` as a user runs it: a subprocess, its JSON, Chrome file, database and errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.otlp import OtlpReceiver
from trims.evaluation.tracing import store
from trims.tracing.levels import Level


def trims(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trims.cli", "trace", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        check=False,
    )


def test_trace_writes_json_chrome_and_stores(residual_path: Path, tmp_path: Path) -> None:
    out, chrome, db = tmp_path / "t.json", tmp_path / "t.trace.json", tmp_path / "r.sqlite"
    done = trims(
        str(residual_path),
        "--framework",
        "onnxruntime",
        "--level",
        "layer",
        "--runs",
        "5",
        "--quick",
        "--json",
        str(out),
        "--chrome",
        str(chrome),
        "--db",
        str(db),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    body = json.loads(out.read_text())
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
    assert [lv["level"] for lv in body["levels"]] == ["model", "layer"]
    assert {"level", "latency_ms", "overhead_pct", "runs"} <= set(body["levels"][0])
    assert {"name", "op_type", "latency_ms", "share_pct", "gflops"} <= set(body["layers"][0])
    assert "level  latency ms" in done.stdout and body["trace_id"] in done.stdout
    events = json.loads(chrome.read_text())
    assert events["otherData"]["trace_id"] == body["trace_id"]
    complete = [e for e in events["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in complete} == {"model", "layer"}
    assert {e["name"] for e in events["traceEvents"] if e["ph"] == "M"} >= {
        "process_name",
        "thread_name",
    }
    trace, summary = store.load_trace(str(db), body["trace_id"])
    assert summary == body and len(trace.spans) == len(complete)
    # a second trace, compared with the first by its id in the same database
    done = trims(
        str(residual_path),
        "--framework",
        "torch",
        "--level",
        "model",
        "--runs",
        "3",
        "--quick",
        "--db",
        str(db),
        "--compare",
        body["trace_id"],
        "--json",
        str(tmp_path / "u.json"),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    compared = json.loads((tmp_path / "u.json").read_text())["compare"]
    assert compared["a"]["trace_id"] == body["trace_id"] and compared["b"]["framework"] == "torch"
    assert "compare a=residual (onnxruntime" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--level", "deep"], "model, layer, library, kernel, full"),
        (["--level", "none"], "model, layer, library, kernel, full"),
        (["--framework", "tensorflow"], "torch, onnxruntime, mxnet"),
        (["--runs", "0"], "runs must be between 1 and"),
    ],
)
def test_bad_input_is_a_clear_error(
    args: list[str], message: str, residual_path: Path, tmp_path: Path
) -> None:
    done = trims(str(residual_path), *args, "--db", str(tmp_path / "r.sqlite"), cwd=tmp_path)
    assert done.returncode == 1
    assert message in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.startswith("trims trace: error:")


def test_unknown_model_is_a_clear_error(tmp_path: Path) -> None:
    done = trims(str(tmp_path / "nope.onnx"), "--db", str(tmp_path / "r.sqlite"), cwd=tmp_path)
    assert done.returncode == 1 and "neither a zoo model" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_manifest_names_the_model(tmp_path: Path) -> None:
    """A shipped manifest's name traces the model it describes (its prepare: builder's ONNX)."""
    out = tmp_path / "t.json"
    done = trims(
        "digits-mlp",
        "--framework",
        "onnxruntime",
        "--level",
        "layer",
        "--runs",
        "5",
        "--quick",
        "--json",
        str(out),
        "--no-store",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    body = json.loads(out.read_text())
    assert body["model"] == "digits-mlp" and body["framework"] == "onnxruntime"
    assert {layer["op_type"] for layer in body["layers"]} >= {"Gemm"}


def test_a_manifest_trace_cannot_run_is_refused_with_the_reason(tmp_path: Path) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text(
        (
            Path(__file__).parents[3] / "evaluation" / "manifests" / "mnist-cnn-torch.yaml"
        ).read_text()
    )
    done = trims(str(manifest), "--no-store", cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "trims trace runs ONNX files" in done.stderr


def test_otlp_endpoint_receives_the_trace(
    residual_path: Path, tmp_path: Path, otlp_receiver: OtlpReceiver
) -> None:
    out = tmp_path / "t.json"
    done = trims(
        str(residual_path),
        "--framework",
        "onnxruntime",
        "--quick",
        "--runs",
        "3",
        "--otlp-endpoint",
        otlp_receiver.endpoint,
        "--no-store",
        "--json",
        str(out),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    body = json.loads(out.read_text())
    received = otlp_receiver.wait_for(body["trace_id"], body["spans"])
    assert otlp_receiver.errors == []
    roots = [s for s in received.spans if s.parent_id is None]
    assert [s.name for s in roots] == ["predict residual"]
    layers = received.by_level(Level.LAYER)
    assert layers and all(s.parent_id is not None for s in layers)
