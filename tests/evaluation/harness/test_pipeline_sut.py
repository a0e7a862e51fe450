"""The pipeline system under test: examples/pipelines/digits (PNG -> decode -> digits-mlp from
the store -> labels) on a real gateway, evaluated under LoadGen SingleStream, per stage."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from tests.fixtures.gateway import RunningGateway
from tests.fixtures.store import DaemonProcess
from trims.errors import NotFound
from trims.evaluation.harness.datasets import digits
from trims.evaluation.harness.loadgen import LoadGenSettings
from trims.evaluation.harness.pipeline_sut import PipelineSUT, example_specs
from trims.evaluation.harness.prepare import build
from trims.evaluation.harness.run import SampleSet, ScenarioRun, run_scenario
from trims.evaluation.harness.sut import DirectSUT

EXAMPLE = Path(__file__).parents[3] / "examples" / "pipelines" / "digits"
EVALUATION_KEYS = {
    "model", "version", "framework", "scenario", "sut", "mode", "valid", "qps", "latency_ms",
    "accuracy",
}  # fmt: skip
SAMPLES = 36
STAGES = {"decode", "classify", "labels", "total"}


def _png(image: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray((image * 15).astype(np.uint8), mode="L").save(out, format="PNG")
    return out.getvalue()


def _example_module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"digits_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_minimal_png_reader_matches_pillow() -> None:
    from PIL import Image

    read_gray8 = _example_module("pngread").read_gray8
    rng = np.random.default_rng(0)
    smooth = np.cumsum(rng.integers(0, 3, (28, 28)), axis=1).astype(np.uint8)
    for image in (smooth, rng.integers(0, 256, (5, 9)).astype(np.uint8)):
        for mode in ("L", "LA"):
            picture = Image.fromarray(image, mode="L").convert(mode)
            out = io.BytesIO()
            picture.save(out, format="PNG")
            np.testing.assert_array_equal(read_gray8(out.getvalue()), image)
    with pytest.raises(ValueError, match="8-bit grayscale"):
        out = io.BytesIO()
        Image.fromarray(smooth, mode="L").convert("RGB").save(out, format="PNG")
        read_gray8(out.getvalue())


async def test_digits_pipeline(
    tmp_path: Path,
    store_daemon: DaemonProcess,
    start_gateway: Callable[..., Awaitable[RunningGateway]],
) -> None:
    """Under LoadGen SingleStream (performance, then accuracy) the pipeline answers the direct
    model's class for every digit, and reports each stage's latency percentiles. (A short test
    name: the workers' socket paths live under its tmp dir, and AF_UNIX paths are short.)"""
    model = build("prepare:digits-mlp", tmp_path / "models")
    added = store_daemon.request("add", admin=True, name="digits-mlp", source=str(model))
    assert added["ok"], added
    gw = await start_gateway(store_socket=store_daemon.socket)
    functions, pipeline = example_specs(EXAMPLE)
    assert {f["name"] for f in functions} == {"digits-decode", "digits-classify", "digits-labels"}
    images, labels = digits("test")
    images, labels = images[:SAMPLES], labels[:SAMPLES]
    samples = SampleSet(
        [_png(i) for i in images],
        [int(label) for label in labels],
        lambda out: out["class"],
        name="digits/test PNGs",
    )
    settings = LoadGenSettings(min_duration_ms=300, min_query_count=SAMPLES)

    def evaluate() -> tuple[ScenarioRun, list[Any]]:
        direct = DirectSUT.onnx("digits-mlp", socket_path=store_daemon.socket)
        try:
            flat = [np.asarray(i, dtype=np.float32).reshape(64) * 0.0625 for i in images]
            direct_out = direct.predict(flat)
        finally:
            direct.close()
        sut = PipelineSUT.deploy(gw.url, functions, pipeline, content_type="image/png")
        try:
            run = run_scenario(sut, samples, "single-stream", "both", settings)
        finally:
            sut.close()
        return run, direct_out

    run, direct_out = await asyncio.to_thread(evaluate)
    direct_classes = [int(np.argmax(o["probabilities"])) for o in direct_out]
    pipeline_classes = run.predictions()
    assert pipeline_classes == direct_classes, "the pipeline answers the model's own classes"
    pipeline_accuracy = np.mean(np.asarray(pipeline_classes) == labels)
    direct_accuracy = np.mean(np.asarray(direct_classes) == labels)
    assert pipeline_accuracy == direct_accuracy > 0.8
    assert run.performance is not None and run.performance.qps
    assert set(run.stage_latency_ms) == STAGES
    for stage, figures in run.stage_latency_ms.items():
        assert set(figures) == {"p50", "p90", "p99", "mean"}, stage
        assert 0 <= figures["p50"] <= figures["p90"] <= figures["p99"], stage
    status, _ = await gw.get_json("/v1/pipelines/digits")
    assert status == 404, "close() removes the pipeline deploy() made"
    status, _ = await gw.get_json("/v1/functions/digits-classify")
    assert status == 404, "and its functions"


async def test_pipeline_sut_for_an_unknown_pipeline_is_not_found(
    start_gateway: Callable[..., Awaitable[RunningGateway]],
) -> None:
    gw = await start_gateway()
    with pytest.raises(NotFound, match="no pipeline named 'absent'"):
        await asyncio.to_thread(PipelineSUT, gw.url, "absent")


async def test_pipe_cli(
    tmp_path: Path, start_gateway: Callable[..., Awaitable[RunningGateway]]
) -> None:
    """``trims evaluate run digits-mlp --sut pipeline``: the digits pipeline evaluated end to
    end, its accuracy the manifest's reference, each stage's latency percentiles in the JSON
    (an extra "stages" key) and in the database row (a short name: AF_UNIX paths)."""
    from trims.cli import main
    from trims.evaluation.db import ResultsDB

    gw = await start_gateway()
    out, db = tmp_path / "out.json", tmp_path / "r.sqlite"
    args = ["evaluate", "run", "digits-mlp", "--sut", "pipeline", "--gateway", gw.url,
            "--mode", "both", "--min-duration", "0.2", "--min-queries", "16",
            "--work-dir", str(tmp_path / "w"), "--db", str(db), "--json", str(out)]  # fmt: skip
    assert await asyncio.to_thread(main, args) == 0
    (entry,) = json.loads(out.read_text())["evaluations"]
    assert entry["sut"] == "pipeline" and entry["model"] == "digits-mlp"
    assert set(entry) == {*EVALUATION_KEYS, "stages"}
    assert set(entry["stages"]) == STAGES
    for figures in entry["stages"].values():
        assert 0 <= figures["p50"] <= figures["p90"] <= figures["p99"]
    accuracy = entry["accuracy"]
    assert accuracy["samples"] == 450
    assert abs(accuracy["value"] - accuracy["reference"]) <= 0.005, accuracy
    results = ResultsDB(str(db), readonly=True)
    try:
        (record,) = results.evaluations()
    finally:
        results.close()
    assert record.evaluation.sut == "pipeline"
    assert record.evaluation.settings["stages"] == entry["stages"]
    status, _ = await gw.get_json("/v1/pipelines/digits")
    assert status == 404, "the evaluation removes the pipeline it deployed"
