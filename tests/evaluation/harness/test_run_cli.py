"""``trims evaluate run``: manifests end to end, results recorded, bad input, Ctrl-C, MXNet and
the gateway for torch models."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tests.fixtures.gateway import RunningGateway
from trims.cli import main
from trims.evaluation.harness.loadgen import LoadGenSettings
from trims.evaluation.harness.manifest import load_manifest, shipped_manifest_paths
from trims.evaluation.harness.manifest_run import GatewayTarget, run_manifest

REPO = Path(__file__).parents[3]
SHORT = ["--min-duration", "0.3", "--min-queries", "16"]
EVALUATION_KEYS = {
    "model", "version", "framework", "scenario", "sut", "mode", "valid", "qps", "latency_ms",
    "accuracy",
}  # fmt: skip
TINY = LoadGenSettings(min_duration_ms=300, min_query_count=8, offline_expected_qps=20.0)


def shipped(name: str) -> Path:
    return next(p for p in shipped_manifest_paths() if p.stem == name)


def trims(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trims.cli", *args],
        capture_output=True, text=True, cwd=cwd, timeout=600, check=False,
    )  # fmt: skip


def listed(db: Path, cwd: Path) -> list[dict[str, Any]]:
    done = trims("evaluate", "ls", "--json", "--db", str(db), cwd=cwd)
    assert done.returncode == 0, done.stderr
    rows: list[dict[str, Any]] = json.loads(done.stdout)["evaluations"]
    return rows


def test_digits_offline_both_writes_the_json_and_records_the_row(tmp_path: Path) -> None:
    db, out = tmp_path / "results.sqlite", tmp_path / "out.json"
    done = trims(
        "evaluate", "run", "digits-mlp", "--scenario", "offline", "--mode", "both",
        "--json", str(out), "--db", str(db), *SHORT, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "recorded as id 1" in done.stderr
    assert "digits-mlp" in done.stdout, "the table at the end names the model"
    body = json.loads(out.read_text())
    assert set(body) == {"system", "evaluations"}
    assert body["system"]["cores"] >= 1 and "frameworks" in body["system"]
    (entry,) = body["evaluations"]
    assert set(entry) == EVALUATION_KEYS
    assert (entry["model"], entry["framework"], entry["scenario"], entry["sut"], entry["mode"]) == (
        "digits-mlp", "onnxruntime", "offline", "direct", "both",
    )  # fmt: skip
    assert entry["qps"] > 0 and set(entry["latency_ms"]) == {"p50", "p90", "p99"}
    accuracy = entry["accuracy"]
    assert set(accuracy) == {"metric", "value", "reference", "dataset", "samples"}
    assert accuracy["metric"] == "top1" and accuracy["samples"] == 450
    assert abs(accuracy["value"] - accuracy["reference"]) <= 0.005
    (row,) = listed(db, tmp_path)
    assert row["model"] == "digits-mlp" and row["accuracy"]["value"] == accuracy["value"]
    assert row["mode"] == "both" and row["executor"] == "local"


def test_a_torch_family_model_in_single_stream_has_no_accuracy(tmp_path: Path) -> None:
    db, out = tmp_path / "results.sqlite", tmp_path / "out.json"
    done = trims(
        "evaluate", "run", "torch-resnet18", "--scenario", "single-stream",
        "--json", str(out), "--db", str(db), "--threads", "2", *SHORT, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (entry,) = json.loads(out.read_text())["evaluations"]
    assert (entry["framework"], entry["mode"], entry["accuracy"]) == ("torch", "performance", None)
    assert entry["qps"] > 0
    (row,) = listed(db, tmp_path)
    assert row["threads"] == 2 and row["framework_version"].startswith("2.")


def test_an_offline_batch_sweep_records_one_evaluation_per_batch(tmp_path: Path) -> None:
    db = tmp_path / "results.sqlite"
    done = trims(
        "evaluate", "run", "digits-mlp", "--scenario", "offline", "--batch", "1,4,16",
        "--db", str(db), *SHORT, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = listed(db, tmp_path)
    assert [r["batch"] for r in rows] == [1, 4, 16]
    assert {r["scenario"] for r in rows} == {"offline"}


def _variant(tmp_path: Path, base: str, change: Callable[[dict[str, Any]], None]) -> Path:
    doc = yaml.safe_load(shipped(base).read_text())
    change(doc)
    path = tmp_path / f"{base}-bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _extra_field(doc: dict[str, Any]) -> None:
    doc["inputs"][0]["colour"] = "blue"


def _wrong_sha(doc: dict[str, Any]) -> None:
    doc["model"]["sources"][0]["sha256"] = "0" * 64


def _impossible_constraint(doc: dict[str, Any]) -> None:
    doc["framework"]["version"] = "<0.1"


def _missing_dataset(doc: dict[str, Any]) -> None:
    doc["dataset"]["name"] = "no-such-dataset"


@pytest.mark.parametrize(
    ("base", "change", "says"),
    [
        ("digits-mlp", _extra_field, "inputs[0].colour: unknown field"),
        ("onnx-resnet50", _wrong_sha, "model.sources[0].path:"),
        ("torch-resnet18", _impossible_constraint, "framework.version: installed torch"),
        ("digits-mlp", _missing_dataset, "dataset:"),
    ],
)
def test_bad_manifests_give_one_clear_error_and_write_nothing(
    base: str,
    change: Callable[[dict[str, Any]], None],
    says: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bad = _variant(tmp_path, base, change)
    db, out = tmp_path / "results.sqlite", tmp_path / "out.json"
    # a good manifest first: nothing runs, not even the evaluations before the bad one
    code = main(["evaluate", "run", "digits-mlp", str(bad), "--db", str(db), "--json", str(out)])
    assert code == 1
    err = capsys.readouterr().err
    problems = [line for line in err.splitlines() if str(bad) in line]
    assert len(problems) == 1 and says in problems[0], err
    assert "nothing was run" in err and "Traceback" not in err
    assert not db.exists() and not out.exists()


def test_an_unknown_name_lists_the_shipped_manifests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["evaluate", "run", "no-such-model", "--db", str(tmp_path / "r.sqlite")]) == 1
    err = capsys.readouterr().err
    assert "'no-such-model' is neither a shipped manifest nor a file" in err
    assert "digits-mlp" in err and not (tmp_path / "r.sqlite").exists()


def test_ctrl_c_keeps_the_finished_evaluations_and_says_so(tmp_path: Path) -> None:
    db = tmp_path / "results.sqlite"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trims.cli", "evaluate", "run", "digits-mlp", "--scenario",
         "offline", "--batch", "1,2,4", "--db", str(db), "--min-duration", "2",
         "--min-queries", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert proc.stderr is not None
    seen: list[str] = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("[2/3]") and line.rstrip().endswith(": running"):
                proc.send_signal(signal.SIGINT)
                break
        else:
            pytest.fail("the second evaluation never started:\n" + "".join(seen))
        _, rest = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    err = "".join(seen) + rest
    assert any(s.startswith("[1/3]") and "recorded as id 1" in s for s in seen), err
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    first = "digits-mlp onnxruntime offline direct batch 1 (id 1)"
    assert f"interrupted: 1 evaluation(s) recorded: {first}" in err
    assert "batch 2 (interrupted)" in err and "batch 4 (not started)" in err
    rows = listed(db, tmp_path)
    assert [r["batch"] for r in rows] == [1], "exactly the finished evaluation is in the database"


def _mxnet_python() -> str | None:
    from trims.evaluation.tracing.mxnet_workload import find_python

    python = find_python()
    return python if Path(python).is_file() else None


@pytest.mark.skipif(
    _mxnet_python() is None,
    reason="no MXNet environment ($TRIMS_MXNET_PYTHON or /tmp/trims-mxnet-venv, as .ci/run makes)",
)
def test_the_mxnet_sut_runs_a_zoo_model_in_its_child(tmp_path: Path) -> None:
    manifest = load_manifest(shipped("squeezenet-mxnet"))
    result = run_manifest(manifest, "direct", "single-stream", "both", TINY, work_dir=tmp_path)
    assert result.framework_version.startswith("1.9")
    assert result.run.performance is not None and result.run.performance.qps is not None
    assert result.accuracy is None, "MXNet runs seeded random weights: performance only"
    assert sorted(result.run.outputs) == list(range(manifest.dataset.samples))
    first = result.run.outputs[0]["softmaxout_1"]
    assert first.size == 1000 and np.isclose(first.sum(), 1.0, atol=1e-3)
    evaluation = result.to_evaluation("both")
    assert evaluation.framework == "mxnet" and len(evaluation.model_digest) == 64


def test_mxnet_manifests_refuse_the_pipeline_before_running(tmp_path: Path) -> None:
    from trims.errors import ValidationError

    manifest = load_manifest(shipped("squeezenet-mxnet"))
    with pytest.raises(ValidationError, match="mxnet models run on the direct or gateway system"):
        run_manifest(
            manifest, "pipeline", "offline", work_dir=tmp_path,
            gateway=GatewayTarget("http://127.0.0.1:9", tmp_path),
        )  # fmt: skip


@pytest.mark.skipif(
    _mxnet_python() is None,
    reason="no MXNet environment ($TRIMS_MXNET_PYTHON or /tmp/trims-mxnet-venv, as .ci/run makes)",
)
async def test_mxnet_on_gateway(
    tmp_path: Path, start_gateway: Callable[..., Awaitable[RunningGateway]]
) -> None:
    """An MXNet manifest served by a function in the gateway's ``mxnet`` environment gives the
    direct MXNet system under test's outputs (both seed the weights alike)."""
    python = _mxnet_python()
    assert python is not None
    doc = yaml.safe_load(shipped("squeezenet-mxnet").read_text())
    doc["dataset"]["samples"] = 3
    # A short name: the instance's socket path (under tmp_path) must fit AF_UNIX's 108 bytes.
    doc["name"] = "sq-mx"
    path = tmp_path / "sq-mx.yaml"
    path.write_text(yaml.safe_dump(doc))
    manifest = load_manifest(path)
    gw = await start_gateway(environments={"mxnet": python})
    target = GatewayTarget(gw.url, REPO / "examples" / "onnx_zoo")

    def evaluate() -> tuple[Any, Any]:
        over_http = run_manifest(
            manifest, "gateway", "single-stream", "both", TINY, work_dir=tmp_path,
            gateway=target, threads=1,
        )  # fmt: skip
        in_process = run_manifest(
            manifest, "direct", "single-stream", "accuracy", TINY, work_dir=tmp_path,
            mxnet_python=python,
        )  # fmt: skip
        return over_http, in_process

    over_http, in_process = await asyncio.to_thread(evaluate)
    assert over_http.sut_kind == "gateway" and over_http.run.performance is not None
    assert over_http.model_digest == in_process.model_digest
    assert over_http.accuracy is None, "MXNet runs seeded random weights: performance only"
    assert sorted(over_http.run.outputs) == [0, 1, 2]
    for i, out in in_process.run.outputs.items():
        np.testing.assert_allclose(
            over_http.run.outputs[i]["softmaxout_1"], out["softmaxout_1"], rtol=1e-4, atol=1e-6
        )
    status, _ = await gw.get_json("/v1/functions/eval-sq-mx")
    assert status == 404, "the evaluation removes the function it deployed"


async def test_torch_on_gateway(
    tmp_path: Path, start_gateway: Callable[..., Awaitable[RunningGateway]]
) -> None:
    """The gateway SUT serves a torch manifest with the direct SUT's outputs (a short test
    name: the instances' Unix sockets live under tmp_path, AF_UNIX paths are short)."""
    doc = yaml.safe_load(shipped("torch-resnet18").read_text())
    doc["dataset"]["samples"] = 3
    path = tmp_path / "torch-resnet18-small.yaml"
    path.write_text(yaml.safe_dump(doc))
    manifest = load_manifest(path)
    gw = await start_gateway()
    target = GatewayTarget(gw.url, REPO / "examples" / "onnx_zoo")

    def evaluate() -> tuple[Any, Any]:
        over_http = run_manifest(
            manifest, "gateway", "single-stream", "both", TINY, work_dir=tmp_path,
            gateway=target, threads=1,
        )  # fmt: skip
        in_process = run_manifest(
            manifest, "direct", "single-stream", "accuracy", TINY, work_dir=tmp_path
        )
        return over_http, in_process

    over_http, in_process = await asyncio.to_thread(evaluate)
    assert over_http.sut_kind == "gateway" and over_http.run.performance is not None
    assert over_http.model_digest == in_process.model_digest
    assert sorted(over_http.run.outputs) == [0, 1, 2]
    for i, out in in_process.run.outputs.items():
        np.testing.assert_allclose(
            over_http.run.outputs[i]["logits"], out["logits"], rtol=1e-4, atol=1e-4
        )
    status, _ = await gw.get_json("/v1/functions/eval-torch-resnet18")
    assert status == 404, "the evaluation removes the function it deployed"


def test_docker_executor_needs_the_gateway_sut(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["evaluate", "run", "digits-mlp", "--executor", "docker",
                 "--db", str(tmp_path / "r.sqlite")])  # fmt: skip
    assert code == 1
    assert "--executor docker places the gateway's function" in capsys.readouterr().err


def test_the_gateway_sut_needs_a_url(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRIMS_GATEWAY_URL"}
    done = subprocess.run(
        [sys.executable, "-m", "trims.cli", "evaluate", "run", "digits-mlp", "--sut", "gateway",
         "--db", str(tmp_path / "r.sqlite")],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert "--sut gateway needs the gateway" in done.stderr
    assert not (tmp_path / "r.sqlite").exists()


def test_results_go_to_the_user_data_folder_not_the_working_directory(tmp_path: Path) -> None:
    """Without --db and $TRIMS_RESULTS_DB, ``trims evaluate`` records into
    ``$XDG_DATA_HOME/trims/results.sqlite`` (created 0700) and ``ls`` reads the same file."""
    cwd, data = tmp_path / "cwd", tmp_path / "data"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TRIMS_RESULTS_DB"}
    env["XDG_DATA_HOME"] = str(data)
    base = [sys.executable, "-m", "trims.cli", "evaluate"]
    done = subprocess.run(
        [*base, "run", "digits-mlp", "--quick"],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert list(cwd.iterdir()) == [], "nothing is written into the working directory"
    db = data / "trims" / "results.sqlite"
    assert db.is_file() and (db.parent.stat().st_mode & 0o777) == 0o700
    listed = subprocess.run(
        [*base, "ls", "--json"], capture_output=True, text=True, cwd=cwd, env=env, timeout=120,
        check=False,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["evaluations"]
    assert [row["model"] for row in rows] == ["digits-mlp"]
